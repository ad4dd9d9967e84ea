//! Where in the code: torch's CUDA allocation history (`_record_memory_history` then
//! `_snapshot`) read, replayed and grouped by the line of the user's code that allocated.
//!
//! - `file`: a snapshot file from elsewhere, read with its checks (regular, uncompressed, plausible);
//! - `pickle`: a reader of plain-data pickles that runs nothing;
//! - `parse`: the snapshot pickle into typed events with interned stacks;
//! - `layout`: the allocator's segments followed event by event, for each block's exact size;
//! - `replay`: one device's `memory_allocated` after every event, its peak, the live blocks;
//! - `opening`: what gpuexp saves with a snapshot to make it exact (the state at opening, the true peak);
//! - `sampled`: blocks of steps recorded without stacks given a sampled step's sites;
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
//!
//! The long work (the parse, the replay, the tables) asks a `keep_going` callback now and then
//! whether to go on: its error (`Error::Interrupted`, Ctrl-C) stops the work. The plain entry
//! points pass one that never stops.

pub mod annotation;
pub mod block;
pub mod cell;
pub mod diff;
pub mod file;
pub mod held;
pub mod holders;
pub mod host;
pub mod kinds;
pub mod layout;
pub mod marks;
pub mod modules;
pub mod opening;
pub mod parse;
pub mod peak;
pub mod pickle;
pub mod replay;
pub mod sampled;
pub mod sampling;
pub mod scope;
pub mod sites;
pub mod timeline;

pub use annotation::{annotation, WindowKey};
pub use block::{Block, SiteSource};
pub use cell::{cell_peak_sites, cell_top_site, CellPeakSite};
pub use diff::{diff, Growth, SiteDiff, SiteDiffRow};
pub use held::{oom, still_held, HeldBlock, OomSites, Ooms, OOMS_ANALYSED};
pub use holders::{name_holders, HolderStorages};
pub use host::{host_sites, HostGrowth, HostTrace, HostTraceback, HOST_FRAMES};
pub use kinds::TraceKinds;
pub use marks::{Recorded, StepMark};
pub use modules::{ModuleFamily, ModuleMark, Modules};
pub use parse::{
    Action, AllocationHistory, BlockState, Event, FrameRef, Gpuexp, Opening, Segment, SegmentBlock, StackId, Stacks,
    Window,
};
pub use peak::{peak_sites, site_table, CategoryRow, PeakSites, Rest, SiteRow, SiteTable, TOP_SITES};
pub use replay::{replay, Completeness, Peak, PeakBounds, Replay};
pub use sampled::StepSpan;
pub use sampling::Sampling;
pub use scope::{peak_since, scope_traces, scope_traces_checked, snapshot_traces, DeviceTrace};
pub use sites::{clipped, Attribution, Phase, PlainNamer, Site, SiteKey, SiteNamer, SiteRule, StackText};
pub use timeline::{timeline, Timeline, TimelineSeries, MAX_POINTS};

/// How many items of a long loop (events, blocks) go by between two asks of `keep_going`: a
/// few milliseconds' worth, and a mask next to the work of one item.
const ASK_EVERY: usize = 1 << 14;

/// Asks `keep_going` at item `n` of a long loop, once every `ASK_EVERY` items (at the first too).
fn ask_every(n: usize, keep_going: &mut dyn FnMut() -> crate::error::Result<()>) -> crate::error::Result<()> {
    if n.is_multiple_of(ASK_EVERY) {
        keep_going()
    } else {
        Ok(())
    }
}

/// `work` with a `keep_going` that never stops it, for the plain entry points.
fn unstoppable<T>(work: impl FnOnce(&mut dyn FnMut() -> crate::error::Result<()>) -> crate::error::Result<T>) -> T {
    work(&mut || Ok(())).expect("only keep_going stops the work, and this one never does")
}

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
mod long_strings_tests;
#[cfg(test)]
mod opening_tests;
#[cfg(test)]
mod sampled_tests;
#[cfg(test)]
mod tests;
