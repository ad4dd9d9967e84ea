//! Torch instrumentation: the code that reaches torch's Python API from Rust (its allocator figures,
//! its allocation history, a step's state under fake tensors, a rank's GPU). Torch is found in
//! `sys.modules`, never imported; code that torch calls back is Python (docs/ARCHITECTURE.md).

pub(in crate::bindings) mod cell_trace;
pub(in crate::bindings) mod fakes;
pub(in crate::bindings) mod ledger_mode;
pub(in crate::bindings) mod rank_gpu;
pub(in crate::bindings) mod rngs;
pub(in crate::bindings) mod saved_step;
pub(in crate::bindings) mod step_state;
pub(in crate::bindings) mod torch;
pub(in crate::bindings) mod trace_opening;
pub(in crate::bindings) mod trace_recording;
pub(in crate::bindings) mod trace_sampling;
