//! The faces of `gpuexp._core`: one file per family the module exposes (functions and classes
//! with their docstrings), and `error.rs`, which converts errors once. Each converts arguments,
//! calls the core and converts the answer; none decides.

#[macro_use]
pub(in crate::bindings) mod report; // first: the families below use its `shown_as_table!`
pub(in crate::bindings) mod cell_log;
pub(in crate::bindings) mod compare;
pub(in crate::bindings) mod error;
pub(in crate::bindings) mod estimate;
pub(in crate::bindings) mod explain;
pub(in crate::bindings) mod files;
pub(in crate::bindings) mod finder;
pub(in crate::bindings) mod fit;
pub(in crate::bindings) mod holders;
pub(in crate::bindings) mod kernel;
pub(in crate::bindings) mod live_view;
pub(in crate::bindings) mod monitor;
pub(in crate::bindings) mod oom;
pub(in crate::bindings) mod ranks;
pub(in crate::bindings) mod recorder;
pub(in crate::bindings) mod running;
pub(in crate::bindings) mod scope;
pub(in crate::bindings) mod snapshot;
pub(in crate::bindings) mod status;
pub(in crate::bindings) mod trace;
pub(in crate::bindings) mod training;
pub(in crate::bindings) mod units;
pub(in crate::bindings) mod unreachable;
