//! Iterations found in torch's history where no step completed: a loop with no optimizer,
//! trainer or finder step (an evaluation loop) repeats the same allocations, of the same sizes
//! in the same order, on every pass. The repetition that reaches the failure is found from the
//! sizes asked for, and the allocated bytes at the same point of each repetition are a reading
//! per iteration: a loop that keeps something of each pass rises from one to the next.
//!
//! Where no repetition is found (a loop whose passes differ in size), the floors of the cell's
//! history, the lowest allocated bytes in each `LEVEL_EVERY_US` of it, are readings without
//! iterations: a loop that keeps something raises the floor from one quarter-second to the next.
//!
//! Of the periods that repeat at least [`MIN_REPETITIONS`] times up to the failure, the one whose
//! repetition reaches back furthest is the loop's (a model of identical layers repeats per layer
//! too, but only within one pass); ties go to the shortest. The search gives up past
//! [`MAX_COMPARISONS`] size comparisons (it runs only after an error, over at most the
//! history's ring of events).

use super::series::{Reading, Rising};
use super::LEVEL_EVERY_US;
use crate::trace::{Action, Event, Replay};

/// Repetitions a period needs to count as the loop's.
pub const MIN_REPETITIONS: usize = 6;

/// The search's bound on comparisons of two sizes.
pub const MAX_COMPARISONS: usize = 50_000_000;

/// How far back from the last size `sizes` keeps the period `period`: the count of sizes from
/// the end that equal the one `period` before them.
fn matched(sizes: &[u64], period: usize, comparisons: &mut usize) -> usize {
    let n = sizes.len();
    let mut length = 0;
    while length + period < n && sizes[n - 1 - length] == sizes[n - 1 - length - period] {
        length += 1;
    }
    *comparisons += length + 1;
    length
}

/// The period of `sizes` that reaches back furthest with at least `MIN_REPETITIONS` repetitions
/// up to its end, and how many sizes from the end it covers (its repetitions included).
fn loop_period(sizes: &[u64]) -> Option<(usize, usize)> {
    let mut best: Option<(usize, usize)> = None;
    let mut comparisons = 0;
    for period in 1..=sizes.len() / MIN_REPETITIONS {
        // A multiple of a found period reaches no further back than it.
        if best.is_some_and(|(found, _)| period % found == 0) {
            continue;
        }
        let covered = matched(sizes, period, &mut comparisons) + period;
        if covered >= MIN_REPETITIONS * period && best.is_none_or(|(_, reach)| covered > reach) {
            best = Some((period, covered));
        }
        if comparisons > MAX_COMPARISONS {
            break;
        }
    }
    best
}

/// The rising run at the end of the readings taken once per repetition of the loop found in
/// `events` (the allocations before the failure at `failed`), at the same point of each: None
/// where no allocation repeats `MIN_REPETITIONS` times.
pub fn repeated(events: &[Event], replay: &Replay, failed: usize) -> Option<Rising> {
    let allocations: Vec<usize> =
        (0..failed.min(events.len())).filter(|&i| events[i].action == Action::Alloc).collect();
    let sizes: Vec<u64> = allocations.iter().map(|&i| events[i].size).collect();
    let (period, covered) = loop_period(&sizes)?;
    let last = sizes.len() - 1;
    let repetitions = covered / period;
    let readings = (0..repetitions).rev().map(|back| {
        let event = allocations[last - back * period];
        let count = (repetitions - 1 - back) as u64;
        Reading { time_us: events[event].time_us, allocated: replay.allocated_at(event), count }
    });
    Rising::ending(readings)
}

/// The rising run at the end of the floors of `events` from `since_us` to the failure at
/// `failed`: the lowest allocated bytes after any event in each `LEVEL_EVERY_US` window, the
/// count being the window's number. None where no event falls in the span.
pub fn floors(events: &[Event], replay: &Replay, failed: usize, since_us: i64) -> Option<Rising> {
    let failed = failed.min(events.len());
    let first = events[..failed].partition_point(|e| e.time_us <= since_us);
    let start_us = events.get(first)?.time_us;
    let mut readings: Vec<Reading> = Vec::new();
    for (at, event) in events.iter().enumerate().take(failed).skip(first) {
        let window = ((event.time_us - start_us) / LEVEL_EVERY_US) as u64;
        let allocated = replay.allocated_at(at);
        match readings.last_mut() {
            Some(floor) if floor.count == window => floor.allocated = floor.allocated.min(allocated),
            _ => readings.push(Reading { time_us: event.time_us, allocated, count: window }),
        }
    }
    Rising::ending(readings)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{replay, AllocationHistory};

    const MIB: u64 = 1 << 20;

    fn event(action: Action, addr: u64, size: u64, time_us: i64) -> Event {
        Event { action, addr, size, stream: 0, time_us, stack: 0, device_free: 0, annotation: None }
    }

    /// `setup` allocations of their own sizes, then `passes` passes of a loop that makes a
    /// 2 MiB temporary (freed) and keeps `kept` bytes, then a failure asking 2 MiB.
    fn loop_history(setup: &[u64], passes: u64, kept: u64) -> AllocationHistory {
        let mut events = Vec::new();
        let mut addr = 0x1000_0000u64;
        let mut time = 0;
        let mut next = |action, size, addr| {
            time += 1;
            event(action, addr, size, time)
        };
        for &size in setup {
            addr += 0x100_0000;
            events.push(next(Action::Alloc, size, addr));
        }
        for _ in 0..passes {
            addr += 0x100_0000;
            events.push(next(Action::Alloc, 2 * MIB, addr));
            events.push(next(Action::FreeRequested, 2 * MIB, addr));
            addr += 0x100_0000;
            events.push(next(Action::Alloc, kept, addr));
        }
        events.push(next(Action::Oom, 2 * MIB, 0));
        AllocationHistory { device_traces: vec![events], ..AllocationHistory::default() }
    }

    fn run_of(history: &AllocationHistory) -> Option<Rising> {
        let replayed = replay(history, 0, None);
        let events = &history.device_traces[0];
        repeated(events, &replayed, events.len() - 1)
    }

    #[test]
    fn a_loop_that_keeps_something_each_pass_rises_by_what_it_keeps() {
        let history = loop_history(&[7 * MIB, 3 * MIB], 40, 5 * MIB);
        let run = run_of(&history).expect("a loop repeats");
        assert_eq!(run.rises, 39, "every pass after the first, back to the first");
        assert_eq!(run.total() / run.iterations(), 5 * MIB);
    }

    #[test]
    fn a_loop_that_keeps_nothing_has_no_rise_and_no_loop_has_no_run() {
        let steady = loop_history(&[7 * MIB], 40, 0);
        assert_eq!(run_of(&steady).map(|r| r.rises), Some(0));
        let few = loop_history(&[7 * MIB], 3, 5 * MIB);
        assert_eq!(run_of(&few), None, "three passes are too few to call a loop");
        let sizes: Vec<u64> = (1..=100).collect();
        assert_eq!(loop_period(&sizes), None);
    }

    /// `passes` passes of a loop, a quarter-second each, whose temporary grows by 1 MiB a pass
    /// (no two passes alike) and which keeps `kept` bytes; its events from time 0.
    fn varying_loop(passes: u64, kept: u64) -> AllocationHistory {
        let mut events = Vec::new();
        for pass in 0..passes {
            let (addr, time) = (0x1000_0000 + pass * 0x1000_0000, pass as i64 * LEVEL_EVERY_US);
            events.push(event(Action::Alloc, addr, (pass + 1) * MIB, time));
            events.push(event(Action::FreeRequested, addr, (pass + 1) * MIB, time + 1));
            events.push(event(Action::Alloc, addr + 0x800_0000, kept, time + 2));
        }
        events.push(event(Action::Oom, 2 * MIB, 0, passes as i64 * LEVEL_EVERY_US));
        AllocationHistory { device_traces: vec![events], ..AllocationHistory::default() }
    }

    #[test]
    fn without_a_repetition_the_floors_of_the_cell_rise_by_what_each_quarter_second_kept() {
        let history = varying_loop(30, 5 * MIB);
        let replayed = replay(&history, 0, None);
        let events = &history.device_traces[0];
        assert_eq!(run_of(&history), None, "no two passes alike");
        let run = floors(events, &replayed, events.len() - 1, -1).expect("floors");
        assert_eq!((run.rises, run.total()), (29, 29 * 5 * MIB), "the floor rose each quarter-second");
        let later = floors(events, &replayed, events.len() - 1, 20 * LEVEL_EVERY_US).unwrap();
        assert_eq!(later.rises, 9, "only the windows after the cell began: passes 21 to 30");
        assert_eq!(floors(events, &replayed, 0, -1), None, "nothing before the failure");
        let steady = varying_loop(30, 0);
        let replayed = replay(&steady, 0, None);
        let run = floors(&steady.device_traces[0], &replayed, steady.device_traces[0].len() - 1, -1).unwrap();
        assert_eq!(run.rises, 0, "a loop that keeps nothing has a flat floor");
    }

    #[test]
    fn the_loops_period_reaches_further_back_than_a_layers() {
        // Twelve identical layers (1, 2) per pass, then the pass's own output (9): the layer
        // repeats twelve times, the pass forty.
        let pass: Vec<u64> = std::iter::repeat_n([1, 2], 12).flatten().chain([9]).collect();
        let sizes: Vec<u64> = std::iter::repeat_n(pass.clone(), 40).flatten().collect();
        assert_eq!(loop_period(&sizes), Some((pass.len(), sizes.len())));
        let within_one: Vec<u64> = std::iter::repeat_n([1, 2], 12).flatten().collect();
        assert_eq!(loop_period(&within_one), Some((2, 24)), "one pass alone: the layer is all there is");
    }
}
