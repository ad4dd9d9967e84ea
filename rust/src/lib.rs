//! gpuexp's core: memory experiment scopes for notebooks. Everything with state lives here;
//! the Python package is the IPython glue and the public surface.

pub mod cli;
pub mod finder;
pub mod fork;
pub mod monitor;
pub mod ranks;
pub mod report;
pub mod sampler;
pub mod scope;
pub mod snapshot;
pub mod teardown;

#[cfg(feature = "python")]
mod bindings;
