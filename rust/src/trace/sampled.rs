//! Sampled stacks in the replay: a traced experiment records Python stacks on some training
//! steps only (`crate::stack_sampling` decides which), and the history runs without stacks on the
//! others, every block's size and time still recorded. The step ends gpuexp saw are saved with
//! the snapshot (the `gpuexp` key's `steps`); the replay cuts the trace at them, and gives each
//! block of a step without stacks the site of a sampled step's block: training steps repeat, so
//! the block made at the same place in the step's order of allocations, with the same size asked
//! for, was made by the same line. Where that place holds another size, the nearest block of the
//! same size stands in (and the places after follow it); with none, the block is unattributed.
//!
//! Sizes and times come from the events only, never from the mapping: the peak and the rows'
//! total are exact whatever was mapped.

use std::collections::HashMap;

use serde::Serialize;

use super::parse::{Event, StackId, Stacks};
use super::replay::{Block, Replay};
use crate::units::bytes;

/// What the recording did from a step mark on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Recorded {
    /// Python stacks (and module paths) at each allocation: a sampled step.
    Stacks,
    /// Sizes and times only: a step whose sites are mapped from a sampled one.
    Events,
    /// No traced experiment was open: whatever ran is not gpuexp's sampling.
    Outside,
}

impl Recorded {
    pub fn label(self) -> &'static str {
        match self {
            Recorded::Stacks => "stacks",
            Recorded::Events => "events",
            Recorded::Outside => "outside",
        }
    }

    pub fn parse(text: &str) -> Option<Recorded> {
        [Recorded::Stacks, Recorded::Events, Recorded::Outside].into_iter().find(|r| r.label() == text)
    }
}

/// A traced experiment's opening, a step's end or the last experiment's finish, in Unix
/// microseconds (torch's `time_us` clock), and what the recording did from then on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepMark {
    pub time_us: i64,
    pub recorded: Recorded,
}

/// The events from one mark to the next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepSpan {
    pub start_us: i64,
    pub first_event: usize,
    /// One past its last event.
    pub end_event: usize,
    pub recorded: Recorded,
}

/// Where a block's site comes from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SiteSource {
    /// Its own stack (or it has none to go by: made before recording, autograd's thread).
    #[default]
    Own,
    /// A sampled step's block (`step`: an index into `Replay::steps`).
    Mapped { step: u32 },
    /// Made in a step without stacks, with no block of a sampled step to map it to.
    Unattributed,
}

/// The trace cut at the marks (events before the first mark are in no span).
pub fn spans(events: &[Event], marks: &[StepMark]) -> Vec<StepSpan> {
    let mut spans: Vec<StepSpan> = Vec::with_capacity(marks.len());
    let mut first = 0;
    for mark in marks {
        first += events[first..].partition_point(|event| event.time_us < mark.time_us);
        if let Some(previous) = spans.last_mut() {
            previous.end_event = first;
        }
        spans.push(StepSpan {
            start_us: mark.time_us,
            first_event: first,
            end_event: events.len(),
            recorded: mark.recorded,
        });
    }
    spans
}

/// The sampled step whose sites the step `target` takes: the latest one before it, else the
/// first one after.
fn source_of(spans: &[StepSpan], target: usize) -> Option<usize> {
    let sampled = |index: &usize| spans[*index].recorded == Recorded::Stacks;
    (0..target).rev().find(sampled).or_else(|| (target + 1..spans.len()).find(sampled))
}

/// The place in `places` (sorted) nearest to `guess`.
fn nearest(places: &[usize], guess: isize) -> Option<usize> {
    let after = places.partition_point(|&place| (place as isize) < guess);
    let candidates = [after.checked_sub(1), Some(after)];
    candidates
        .into_iter()
        .flatten()
        .filter_map(|i| places.get(i).copied())
        .min_by_key(|&place| (place as isize - guess).abs())
}

/// Gives the blocks of the steps recorded without stacks their sites from sampled steps.
/// `blocks` are the trace's own, in order of allocation; `context` is each event's stack (see
/// `Replay::context`), which the events of those steps get from the blocks they map to.
pub(super) fn map_sites(spans: &[StepSpan], blocks: &mut [Block], context: &mut [StackId], stacks: &Stacks) {
    if !spans.iter().any(|span| span.recorded == Recorded::Events) {
        return;
    }
    // What the replay carried over into a step without stacks is an earlier step's stack.
    for span in spans.iter().filter(|span| span.recorded == Recorded::Events) {
        context[span.first_event..span.end_event].fill(0);
    }
    let allocs: Vec<usize> = blocks.iter().map(|block| block.alloc_event.unwrap_or(0)).collect();
    let blocks_of = |span: &StepSpan| {
        allocs.partition_point(|&event| event < span.first_event)
            ..allocs.partition_point(|&event| event < span.end_event)
    };
    for (target, span) in spans.iter().enumerate().filter(|(_, span)| span.recorded == Recorded::Events) {
        let source = source_of(spans, target);
        let from = source.map_or(0..0, |source| blocks_of(&spans[source]));
        let mut by_size: HashMap<u64, Vec<usize>> = HashMap::new();
        for (place, block) in from.clone().enumerate() {
            by_size.entry(blocks[block].requested).or_default().push(place);
        }
        let mut shift = 0isize;
        for (place, block) in blocks_of(span).enumerate() {
            if !stacks.is_bare(blocks[block].stack) {
                continue; // a stack of its own: recorded as the step switched
            }
            blocks[block].module = None;
            blocks[block].sites = SiteSource::Unattributed;
            let asked = blocks[block].requested;
            let guess = place as isize + shift;
            let same_place =
                usize::try_from(guess).ok().filter(|&p| p < from.len() && blocks[from.start + p].requested == asked);
            let Some(matched) = same_place.or_else(|| nearest(by_size.get(&asked)?, guess)) else {
                continue;
            };
            shift = matched as isize - place as isize;
            let model = blocks[from.start + matched].clone();
            let step = source.expect("a match has a source") as u32;
            let mapped = &mut blocks[block];
            mapped.stack = model.stack;
            mapped.module = model.module;
            mapped.sites = SiteSource::Mapped { step };
            let (Some(alloc), Some(model_alloc)) = (mapped.alloc_event, model.alloc_event) else { continue };
            context[alloc] = context[model_alloc];
            if let (Some(free), Some(model_free)) = (mapped.free_event, model.free_event) {
                context[free] = context[model_free];
            }
        }
    }
}

/// How the sites of a window's peak were found, where gpuexp's sampling recorded the trace.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Sampling {
    /// Steps in the window: the stretches between step ends that allocated (the one running at
    /// its end too).
    pub steps: usize,
    /// Of them, those recorded with Python stacks.
    pub with_stacks: usize,
    /// Bytes live at the peak whose site is their own stack's (or their phase's).
    pub direct_bytes: u64,
    /// Bytes live at the peak whose site is a sampled step's block's.
    pub mapped_bytes: u64,
    /// Bytes live at the peak made in a step without stacks, with no block to map them to.
    pub unattributed_bytes: u64,
    /// The steps (numbered from 1 at the window's opening; 0: before it) the mapped sites come from.
    pub sites_from_steps: Vec<usize>,
}

impl Sampling {
    /// Python stacks on every step of the window: nothing was mapped.
    pub fn full(&self) -> bool {
        self.with_stacks == self.steps
    }

    /// One line for the report's notes.
    pub fn describe(&self) -> String {
        if self.full() {
            return match self.steps {
                0 | 1 => "attribution: full, Python stacks on every allocation".to_string(),
                n => format!("attribution: full, Python stacks on all {n} steps"),
            };
        }
        let from = match self.sites_from_steps.as_slice() {
            [] => String::new(),
            [step] => format!(" from step {step}"),
            steps => format!(" from steps {}", steps.iter().map(usize::to_string).collect::<Vec<_>>().join(", ")),
        };
        format!(
            "attribution sampled: Python stacks on {} of {} steps, the others recorded without stacks (every size \
             exact); at the peak {} attributed directly, {} mapped{from} by order of allocation and size, {} \
             unattributed (gpuexp.config(trace_sampling=False): stacks on every step)",
            self.with_stacks,
            self.steps,
            bytes(self.direct_bytes),
            bytes(self.mapped_bytes),
            bytes(self.unattributed_bytes)
        )
    }
}

/// The sampling of the window from `since_us` on and where the sites of `live` (its peak's
/// blocks) came from; None where the trace holds no step mark of gpuexp's.
pub fn summary(replay: &Replay, since_us: i64, live: &[&Block]) -> Option<Sampling> {
    let spans = &replay.steps;
    if spans.is_empty() {
        return None;
    }
    // A stretch that allocated nothing (after the last step end, say) is no step.
    let mut allocated = vec![false; spans.len()];
    for event in replay.blocks.iter().filter_map(|block| block.alloc_event) {
        let span = spans.partition_point(|span| span.first_event <= event);
        if let Some(span) = span.checked_sub(1).filter(|&span| event < spans[span].end_event) {
            allocated[span] = true;
        }
    }
    // A step is in the window when it ends after the opening.
    let in_window: Vec<usize> = (0..spans.len())
        .filter(|&i| spans[i].recorded != Recorded::Outside && allocated[i])
        .filter(|&i| spans.get(i + 1).is_none_or(|next| next.start_us > since_us))
        .collect();
    let number = |span: usize| in_window.iter().position(|&i| i == span).map_or(0, |p| p + 1);
    let mut sampling = Sampling {
        steps: in_window.len(),
        with_stacks: in_window.iter().filter(|&&i| spans[i].recorded == Recorded::Stacks).count(),
        direct_bytes: 0,
        mapped_bytes: 0,
        unattributed_bytes: 0,
        sites_from_steps: Vec::new(),
    };
    for block in live {
        match block.sites {
            SiteSource::Own => sampling.direct_bytes += block.bytes,
            SiteSource::Unattributed => sampling.unattributed_bytes += block.bytes,
            SiteSource::Mapped { step } => {
                sampling.mapped_bytes += block.bytes;
                sampling.sites_from_steps.push(number(step as usize));
            }
        }
    }
    sampling.sites_from_steps.sort_unstable();
    sampling.sites_from_steps.dedup();
    Some(sampling)
}
