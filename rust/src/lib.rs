//! gpuexp's core: memory experiment scopes for notebooks. Everything with state lives here;
//! the Python package is the IPython glue and the public surface.

pub mod finder;
pub mod grid;
pub mod monitor;
pub mod peak_sampler;
pub mod report;
pub mod scope;
pub mod snapshot;
pub mod status;
pub mod teardown;
pub mod units;
pub mod watch;

#[cfg(feature = "python")]
mod bindings;
