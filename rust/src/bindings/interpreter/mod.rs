//! The interpreter: the user's namespace, the heap the leak hunter walks, interrupts held
//! across a job, tracemalloc, forks, and the registry's lock.

pub(in crate::bindings) mod fork;
pub(in crate::bindings) mod host_trace;
pub(in crate::bindings) mod hunt_roots;
pub(in crate::bindings) mod interrupts;
pub(in crate::bindings) mod namespace;
pub(in crate::bindings) mod python_heap;
pub(in crate::bindings) mod registry;
