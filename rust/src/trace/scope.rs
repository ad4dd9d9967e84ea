//! What a traced experiment found on each of its GPUs: its peak by site, the timeline, what it
//! left held and where it ran out of memory. A recording shared with the user (or with an outer
//! traced experiment) holds more than the scope: its window starts at the scope's opening.

use serde::Serialize;

use super::held::{oom_checked, still_held_checked, HeldBlock, OomSites};
use super::parse::AllocationHistory;
use super::peak::{site_table_checked, PeakSites, TOP_SITES};
use super::replay::{replay_checked, Peak, Replay};
use super::sites::Attribution;
use super::timeline::{timeline_checked, Timeline};
use crate::error::Result;

/// One GPU of a traced scope.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DeviceTrace {
    pub torch_index: u32,
    pub peak: PeakSites,
    pub timeline: Timeline,
    /// Blocks the scope allocated that were still alive when it finished, largest first (each
    /// site's stack written once: see `held::each_stack_once`).
    #[serde(serialize_with = "super::held::each_stack_once")]
    pub still_held: Vec<HeldBlock>,
    /// The first `OOMS_ANALYSED` out-of-memory errors of the window.
    pub ooms: Vec<OomSites>,
    /// How many more there were, counted only (a note of the peak says so too).
    pub ooms_not_analysed: usize,
}

/// The highest allocated from the first event at or after `since_us` on (what was allocated
/// when the window opened counts too).
pub fn peak_since(replay: &Replay, since_us: i64) -> Peak {
    let first = first_event(replay, since_us);
    let opening = match first.checked_sub(1) {
        Some(before) => Peak { event: Some(before), bytes: replay.allocated[before], time_us: since_us },
        None => Peak { event: None, bytes: replay.baseline, time_us: since_us },
    };
    (first..replay.allocated.len()).fold(opening, |best, event| {
        if replay.allocated[event] > best.bytes {
            Peak { event: Some(event), bytes: replay.allocated[event], time_us: replay.time_us[event] }
        } else {
            best
        }
    })
}

/// The first event at or after `since_us` (the trace's length when none is).
fn first_event(replay: &Replay, since_us: i64) -> usize {
    replay.time_us.iter().position(|&t| t >= since_us).unwrap_or(replay.time_us.len())
}

/// Each of `devices` (torch indices) in `snapshot`, from `since_us` on.
pub fn scope_traces(
    snapshot: &AllocationHistory,
    devices: &[u32],
    max_entries: Option<usize>,
    since_us: i64,
    attribution: &Attribution,
) -> Vec<DeviceTrace> {
    super::unstoppable(|keep_going| {
        scope_traces_checked(snapshot, devices, max_entries, since_us, attribution, keep_going)
    })
}

/// `scope_traces_checked` for `devices` (None: all of them), from `since_us` on (None: from the
/// opening of the experiment the snapshot was saved for, where gpuexp saved it, else all of it),
/// with the ring buffer's `max_entries` (None: as saved with it).
pub fn snapshot_traces(
    snapshot: &AllocationHistory,
    devices: Option<&[u32]>,
    max_entries: Option<u64>,
    since_us: Option<i64>,
    attribution: &Attribution,
    keep_going: &mut dyn FnMut() -> Result<()>,
) -> Result<Vec<DeviceTrace>> {
    let window = snapshot.gpuexp.window.as_ref();
    let max_entries = max_entries.and_then(|m| usize::try_from(m).ok()).or(window.and_then(|w| w.max_entries));
    let since_us = since_us.or(window.map(|w| w.opened_us)).unwrap_or(i64::MIN);
    let all: Vec<u32> = snapshot.devices().into_iter().filter_map(|d| u32::try_from(d).ok()).collect();
    let devices = devices.map(<[u32]>::to_vec).unwrap_or(all);
    scope_traces_checked(snapshot, &devices, max_entries, since_us, attribution, keep_going)
}

/// `scope_traces`, asking `keep_going` every so many events and blocks whether to go on (a
/// large file's analysis takes seconds): its error (`Error::Interrupted`: Ctrl-C) stops it.
pub fn scope_traces_checked(
    snapshot: &AllocationHistory,
    devices: &[u32],
    max_entries: Option<usize>,
    since_us: i64,
    attribution: &Attribution,
    keep_going: &mut dyn FnMut() -> Result<()>,
) -> Result<Vec<DeviceTrace>> {
    devices
        .iter()
        .map(|&torch_index| {
            let replayed = replay_checked(snapshot, torch_index as usize, max_entries, keep_going)?;
            let peak = peak_since(&replayed, since_us);
            let live: Vec<_> = match peak.event {
                Some(event) => replayed.live_at(event).collect(),
                None => replayed.blocks.iter().filter(|b| b.before_recording()).collect(),
            };
            let ooms = oom_checked(snapshot, &replayed, attribution, TOP_SITES, since_us, keep_going)?;
            let mut completeness = replayed.completeness.clone();
            completeness.unknown.extend(ooms.note());
            let sites = PeakSites {
                device: replayed.device,
                peak,
                table: site_table_checked(&replayed, attribution, &live, TOP_SITES, keep_going)?,
                completeness,
                bounds: replayed.peak_bounds(first_event(&replayed, since_us)),
                true_peak: snapshot.gpuexp.true_peak(torch_index as usize),
                sampling: super::sampling::summary(&replayed, since_us, &live),
            };
            let in_scope: Vec<u64> = replayed
                .live_at_end()
                .filter(|b| b.alloc_event.is_some_and(|event| replayed.time_us[event] >= since_us))
                .map(|b| b.addr)
                .collect();
            let mut held = still_held_checked(&replayed, attribution, Some(&in_scope), keep_going)?;
            held.sort_by_key(|block| std::cmp::Reverse(block.bytes));
            Ok(DeviceTrace {
                torch_index,
                timeline: timeline_checked(&replayed, attribution, TOP_SITES, keep_going)?,
                peak: sites,
                still_held: held,
                ooms: ooms.analysed,
                ooms_not_analysed: ooms.not_analysed,
            })
        })
        .collect()
}
