//! Where in the code: torch's CUDA allocation history (`_record_memory_history` then
//! `_snapshot`) read, replayed and grouped by the line of the user's code that allocated.
//!
//! - `file`: a snapshot file from elsewhere, read with its checks (regular, uncompressed, plausible);
//! - `pickle`: a reader of plain-data pickles that runs nothing;
//! - `parse`: the snapshot pickle into typed events with interned stacks;
//! - `layout`: the allocator's segments followed event by event, for each block's exact size;
//! - `replay`: one device's `memory_allocated` after every event, its peak, the live blocks;
//! - `opening`: what gpuexp saves with a snapshot to make it exact (the state at opening, the true peak);
//! - `modules`: the `nn.Module` (path, forward or backward) gpuexp's hooks marked an allocation with;
//! - `sites`: a block's site (the innermost user frame, else its phase) and category;
//! - `peak`: the live set at the peak (or any moment) by site, as tables and JSON;
//! - `diff`: why one trace peaks higher than another, site by site, against the params;
//! - `timeline`: allocated over time stacked by the top sites, as data and as SVG;
//! - `held`: the sites of blocks alive at the end (leaks) and at an OOM;
//! - `kinds`: what `trace=` records (CUDA, host, both);
//! - `host`: the host's Python allocations (tracemalloc) grown by site;
//! - `holders`: which holder the leak hunter named keeps each block alive at the end;
//! - `cell`: a notebook cell's peak by site, for the cell log.

pub mod cell;
pub mod diff;
pub mod file;
pub mod held;
pub mod holders;
pub mod host;
pub mod kinds;
pub mod layout;
pub mod modules;
pub mod opening;
pub mod parse;
pub mod peak;
pub mod pickle;
pub mod replay;
pub mod scope;
pub mod sites;
pub mod timeline;

pub use cell::{cell_peak_sites, cell_top_site, CellPeakSite};
pub use diff::{diff, Growth, SiteDiff, SiteDiffRow};
pub use held::{oom, still_held, HeldBlock, OomSites};
pub use holders::{name_holders, HolderStorages};
pub use host::{host_sites, HostGrowth, HostTrace, HostTraceback, HOST_FRAMES};
pub use kinds::TraceKinds;
pub use modules::{ModuleFamily, ModuleMark, Modules};
pub use parse::{
    Action, BlockState, Event, FrameRef, Gpuexp, Opening, Segment, SegmentBlock, Snapshot, StackId, Stacks, Window,
};
pub use peak::{peak_sites, site_table, CategoryRow, PeakSites, Rest, SiteRow, SiteTable, TOP_SITES};
pub use replay::{replay, Block, Completeness, Peak, PeakBounds, Replay};
pub use scope::{peak_since, scope_traces, DeviceTrace};
pub use sites::{Attribution, Phase, PlainNamer, Site, SiteKey, SiteNamer, SiteRule};
pub use timeline::{timeline, Timeline, TimelineSeries, MAX_POINTS};

#[cfg(test)]
mod bench;
#[cfg(test)]
mod cell_tests;
#[cfg(test)]
mod holders_tests;
#[cfg(test)]
mod hostile_files_tests;
#[cfg(test)]
mod hostile_tests;
#[cfg(test)]
mod opening_tests;
#[cfg(test)]
mod tests;
