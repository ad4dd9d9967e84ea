//! One device's trace walked in order: torch's `memory_allocated` after every event, the peak,
//! and which blocks were alive at any moment.
//!
//! The counter moves as torch's does: up by the block's size at `alloc`, down at `free_requested`
//! (a block still busy on another stream is no longer allocated). The trace records the size the
//! caller asked for; the block's size is what the counter counts. It is the allocator's own
//! figure where one is known: the snapshot's segments for blocks still there, the allocator's
//! state when the recording began (gpuexp takes it: `opening`) for blocks from before, and the
//! layout of its segments followed event by event (`layout`) for the rest. Elsewhere it is
//! inferred from the request, and `Replay::peak_bounds` says how far the true peak can be.
//! Blocks allocated before recording began are reconstructed from their frees and from the
//! segments, so the figures add up to torch's even when the ring buffer wrapped.

use std::collections::HashMap;

use serde::Serialize;

use super::block::{Block, SiteSource};
use super::layout::{round, Layout};
use super::modules::Modules;
use super::parse::{Action, AllocationHistory, BlockState, StackId};
use super::sampled::StepSpan;
use crate::error::Result;

/// Where the true peak lies when block sizes were inferred.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct PeakBounds {
    pub at_least: u64,
    pub at_most: u64,
}

/// The highest `memory_allocated` reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Peak {
    /// The event after which it was reached; None when it was before the first event.
    pub event: Option<usize>,
    pub bytes: u64,
    pub time_us: i64,
}

/// How much of the program's history the trace holds, and what is unknown because of it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Completeness {
    pub events: usize,
    /// The cap the recording ran with, when known.
    pub max_entries: Option<usize>,
    /// The ring buffer may have dropped its oldest events.
    pub may_have_wrapped: bool,
    /// Frees of blocks whose allocation is not in the trace.
    pub unknown_frees: usize,
    /// Blocks alive at the end per the segments whose allocation is not in the trace.
    pub alive_from_before: usize,
    /// Blocks whose size could not be read from the segments and was inferred.
    pub inferred_sizes: usize,
    /// Blocks from before the recording freed in it whose size the state at its start gave.
    pub sized_from_opening: usize,
    /// What is unknown, in words, for the report.
    pub unknown: Vec<String>,
}

/// A device's trace replayed.
#[derive(Clone, Debug)]
pub struct Replay {
    pub device: usize,
    /// Every allocation seen or reconstructed, in order of allocation (reconstructed first).
    pub blocks: Vec<Block>,
    /// `memory_allocated` before the first event: the blocks alive before recording.
    pub baseline: u64,
    /// `memory_allocated` just after each event.
    pub allocated: Vec<u64>,
    /// Each event's own stack, or the nearest earlier one with frames: where a frameless
    /// allocation (autograd's engine thread) was made from.
    pub context: Vec<StackId>,
    pub time_us: Vec<i64>,
    pub peak: Peak,
    pub completeness: Completeness,
    /// The module families the blocks' marks name.
    pub modules: Modules,
    /// The trace cut at gpuexp's step marks, where it saved them (empty: none).
    pub steps: Vec<StepSpan>,
}

/// Walks `device`'s trace. `max_entries` is the cap the recording ran with, when known: a trace
/// that long may have wrapped.
pub fn replay(snapshot: &AllocationHistory, device: usize, max_entries: Option<usize>) -> Replay {
    super::unstoppable(|keep_going| replay_checked(snapshot, device, max_entries, keep_going))
}

/// `replay`, asking `keep_going` every so many events whether to go on.
pub(super) fn replay_checked(
    snapshot: &AllocationHistory,
    device: usize,
    max_entries: Option<usize>,
    keep_going: &mut dyn FnMut() -> Result<()>,
) -> Result<Replay> {
    let events = snapshot.device_traces.get(device).map(Vec::as_slice).unwrap_or(&[]);
    let segment_blocks: HashMap<u64, &super::parse::SegmentBlock> = snapshot
        .segments
        .iter()
        .filter(|segment| segment.device == device)
        .flat_map(|segment| &segment.blocks)
        .map(|block| (block.address, block))
        .collect();
    // The allocator's state when the recording began, where gpuexp took it: every block from
    // before then has its exact size, and every free block its extent.
    let opening = snapshot.gpuexp.opening_of(device, events.len(), max_entries);
    let mut layout = opening.as_deref().map(Layout::opening).unwrap_or_default();
    let mut blocks: Vec<Block> = Vec::new();
    // Addresses are the file's to choose: hashed with a random seed (foldhash), so no file can
    // make them collide, and fast enough for two lookups an event over millions of events.
    let mut live: foldhash::HashMap<u64, usize> = HashMap::default();
    let mut before: Vec<Block> = Vec::new();
    let mut deltas: Vec<i64> = Vec::with_capacity(events.len());
    let mut context = Vec::with_capacity(events.len());
    let mut completeness = Completeness { events: events.len(), max_entries, ..Completeness::default() };
    let mut last_stack = 0;
    let mut modules = Modules::default();
    for (index, event) in events.iter().enumerate() {
        super::ask_every(index, keep_going)?;
        if !snapshot.stacks.is_bare(event.stack) {
            last_stack = event.stack;
        }
        context.push(last_stack);
        let module = modules.observe(&snapshot.stacks, event.annotation);
        let mut delta = 0i64;
        match event.action {
            Action::Alloc => {
                let exact = layout.alloc(event.addr, event.size);
                let bytes = exact.unwrap_or_else(|| round(event.size));
                if let Some(previous) = live.insert(event.addr, blocks.len()) {
                    // An address handed out twice without a free: the free was not recorded.
                    blocks[previous].free_event = Some(index);
                    delta -= blocks[previous].bytes as i64;
                }
                blocks.push(Block {
                    addr: event.addr,
                    bytes,
                    requested: event.size,
                    stack: event.stack,
                    alloc_event: Some(index),
                    free_event: None,
                    module,
                    exact: exact.is_some(),
                    sites: SiteSource::Own,
                });
                delta += bytes as i64;
            }
            Action::FreeRequested => match live.remove(&event.addr) {
                Some(block) => {
                    blocks[block].free_event = Some(index);
                    delta -= blocks[block].bytes as i64;
                }
                None => {
                    let exact = layout.busy(event.addr);
                    completeness.unknown_frees += 1;
                    completeness.sized_from_opening += usize::from(exact.is_some());
                    let bytes = exact.unwrap_or_else(|| round(event.size));
                    before.push(Block {
                        addr: event.addr,
                        bytes,
                        requested: event.size,
                        stack: 0,
                        alloc_event: None,
                        free_event: Some(index),
                        module: None,
                        exact: exact.is_some(),
                        sites: SiteSource::Own,
                    });
                    delta -= bytes as i64;
                }
            },
            Action::FreeCompleted => layout.free_completed(event.addr),
            Action::SegmentAlloc => layout.segment(event.addr, event.size),
            Action::SegmentMap => layout.map(event.addr, event.size),
            Action::SegmentFree | Action::SegmentUnmap => layout.unmap(event.addr, event.size),
            _ => {}
        }
        deltas.push(delta);
    }
    // Blocks the segments hold that no recorded allocation explains were there all along.
    let mut from_before: Vec<&super::parse::SegmentBlock> = segment_blocks
        .values()
        .filter(|block| block.state == BlockState::ActiveAllocated && !live.contains_key(&block.address))
        .copied()
        .collect();
    from_before.sort_by_key(|block| block.address);
    completeness.alive_from_before = from_before.len();
    before.extend(from_before.iter().map(|block| Block {
        addr: block.address,
        bytes: block.size,
        requested: block.requested_size,
        stack: block.stack,
        alloc_event: None,
        free_event: None,
        module: None,
        exact: true,
        sites: SiteSource::Own,
    }));
    // Blocks still alive take their exact size from the segments.
    for &index in live.values() {
        if let Some(segment_block) = segment_blocks.get(&blocks[index].addr) {
            if segment_block.state == BlockState::ActiveAllocated {
                let correction = segment_block.size as i64 - blocks[index].bytes as i64;
                deltas[blocks[index].alloc_event.expect("recorded")] += correction;
                blocks[index].bytes = segment_block.size;
                blocks[index].exact = true;
            }
        }
    }
    // Steps recorded without stacks take their sites from a sampled step's blocks.
    let steps = snapshot.gpuexp.steps.as_deref().map(|marks| super::sampled::spans(events, marks)).unwrap_or_default();
    super::sampled::map_sites(&steps, &mut blocks, &mut context, &snapshot.stacks);
    completeness.inferred_sizes = before.iter().chain(&blocks).filter(|block| !block.exact).count();
    // Sizes are at most a PiB each (the parse refuses more), but a file may hold many: the sums saturate.
    let baseline: u64 = before.iter().fold(0, |sum, block| sum.saturating_add(block.bytes));
    let mut allocated = Vec::with_capacity(events.len());
    let mut now = i64::try_from(baseline).unwrap_or(i64::MAX);
    let mut peak = Peak { event: None, bytes: baseline, time_us: events.first().map_or(0, |e| e.time_us) };
    for (index, delta) in deltas.iter().enumerate() {
        now = now.saturating_add(*delta);
        let bytes = now.max(0) as u64;
        allocated.push(bytes);
        if bytes > peak.bytes {
            peak = Peak { event: Some(index), bytes, time_us: events[index].time_us };
        }
    }
    // With the cap known, only a full buffer wrapped: frees of older blocks then mean the
    // recording began after them (as when an experiment starts it). Without it, they may mean
    // either, unless the state at the recording's start explains every one.
    let cap = max_entries.or_else(|| snapshot.gpuexp.opening.as_ref().and_then(|opening| opening.max_entries));
    completeness.max_entries = cap;
    completeness.may_have_wrapped = match cap {
        Some(cap) => events.len() >= cap,
        None => completeness.unknown_frees > completeness.sized_from_opening,
    };
    completeness.unknown = unknown_in_words(&completeness);
    before.append(&mut blocks);
    Ok(Replay {
        device,
        blocks: before,
        baseline,
        allocated,
        context,
        time_us: events.iter().map(|event| event.time_us).collect(),
        peak,
        completeness,
        modules,
        steps,
    })
}

fn unknown_in_words(completeness: &Completeness) -> Vec<String> {
    let mut unknown = Vec::new();
    if completeness.may_have_wrapped {
        unknown.push(format!(
            "the trace may have wrapped ({} events{}): what happened before its first event is not in it",
            completeness.events,
            completeness.max_entries.map_or(String::new(), |cap| format!(", cap {cap}"))
        ));
    }
    let inferred = completeness.unknown_frees - completeness.sized_from_opening;
    if completeness.sized_from_opening > 0 {
        unknown.push(format!(
            "{} blocks freed in the trace were allocated before it began: their sites are unknown \
             (their sizes are the allocator's, from its state when the recording began)",
            completeness.sized_from_opening
        ));
    }
    if inferred > 0 {
        unknown.push(format!(
            "{inferred} blocks freed in the trace were allocated before it began: their sites are unknown \
             and their sizes inferred from the size asked for"
        ));
    }
    if completeness.alive_from_before > 0 {
        unknown.push(format!(
            "{} blocks alive throughout were allocated before the trace began",
            completeness.alive_from_before
        ));
    }
    unknown
}

impl Replay {
    /// The blocks alive just after event `event`.
    pub fn live_at(&self, event: usize) -> impl Iterator<Item = &Block> + '_ {
        self.blocks.iter().filter(move |block| block.alive_after(event))
    }

    /// The blocks alive at the peak (before the first event when that was the peak).
    pub fn live_at_peak(&self) -> Vec<&Block> {
        match self.peak.event {
            Some(event) => self.live_at(event).collect(),
            None => self.blocks.iter().filter(|block| block.before_recording()).collect(),
        }
    }

    /// The blocks alive at the end of the trace.
    pub fn live_at_end(&self) -> impl Iterator<Item = &Block> + '_ {
        self.blocks.iter().filter(|block| block.free_event.is_none())
    }

    /// Where the true peak from event `first` on lies, given the blocks whose sizes were
    /// inferred (each within `Block::uncertainty`); None when every size alive then is exact.
    pub fn peak_bounds(&self, first: usize) -> Option<PeakBounds> {
        let events = self.allocated.len();
        // Per event, how much the true figure can be above (over) and below (under) the replayed.
        let (mut over, mut under) = (vec![0i64; events + 1], vec![0i64; events + 1]);
        let mut any = false;
        for block in &self.blocks {
            let (above, below) = block.uncertainty();
            if above == 0 && below == 0 {
                continue;
            }
            any = true;
            let from = block.alloc_event.map_or(0, |event| event + 1);
            over[from] += above as i64;
            under[from] += below as i64;
            if let Some(free) = block.free_event {
                over[free + 1] -= above as i64;
                under[free + 1] -= below as i64;
            }
        }
        if !any {
            return None;
        }
        // Index 0 is before the first event; index e + 1 just after event e.
        let (mut above, mut below) = (0i64, 0i64);
        let mut bounds: Option<PeakBounds> = None;
        for state in 0..=events {
            above += over[state];
            below += under[state];
            if state < first {
                continue;
            }
            let bytes = if state == 0 { self.baseline } else { self.allocated[state - 1] } as i64;
            let (least, most) = ((bytes - below).max(0) as u64, (bytes + above) as u64);
            bounds = Some(match bounds {
                None => PeakBounds { at_least: least, at_most: most },
                Some(b) => PeakBounds { at_least: b.at_least.max(least), at_most: b.at_most.max(most) },
            });
        }
        bounds.filter(|b| b.at_least != b.at_most || b.at_least != self.peak_from(first))
    }

    /// The replayed peak from state `first` on (0: before the first event).
    fn peak_from(&self, first: usize) -> u64 {
        let opening = if first == 0 { self.baseline } else { self.allocated[first - 1] };
        self.allocated.iter().skip(first).copied().fold(opening, u64::max)
    }

    /// `memory_allocated` just after event `event` (the baseline for an empty trace).
    pub fn allocated_at(&self, event: usize) -> u64 {
        self.allocated.get(event).copied().unwrap_or(self.baseline)
    }
}
