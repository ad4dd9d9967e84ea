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

use super::block::{Block, SiteSource};
use super::marks::{Recorded, StepMark};
use super::parse::{Event, StackId, Stacks};

/// The events from one mark to the next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepSpan {
    pub start_us: i64,
    pub first_event: usize,
    /// One past its last event.
    pub end_event: usize,
    pub recorded: Recorded,
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
