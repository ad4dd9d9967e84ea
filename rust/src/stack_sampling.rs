//! Sampled stacks for `trace=True`: which training steps record Python stacks. A stack costs
//! about 2 µs an allocation and the module-path hooks a Python call per block, tens of percent
//! of a launch-bound step (issue 29, bench/RESULTS.md), so a traced experiment records stacks
//! (and runs the hooks) on the first step after its opening and then on one step in `every`;
//! the other steps keep the history running without stacks, every block's size and time
//! recorded. The replay (`trace::sampled`) gives the blocks of those steps the sites of a
//! sampled step's blocks. Where no step boundary is ever seen (no optimizer), stacks stay on.
//!
//! `every` adapts: from the time a sampled step takes against the steps without stacks, so
//! that the stacks' share of the run stays near `STACK_BUDGET`, between `MIN_EVERY` and
//! `MAX_EVERY` (a step of ~2,000 events every 50 steps keeps a sampled step inside torch's ring
//! buffer of 200,000 entries).
//!
//! The sampler only decides: the bindings switch the recording (through the recording lease's
//! ceiling) and the hooks when told, and say what the recording really does then.

use std::collections::VecDeque;

use crate::recorder::StepKind;
use crate::trace::{Recorded, StepMark};

/// Steps from one sampled step to the next before any was timed.
pub const DEFAULT_EVERY: u32 = 10;
/// However cheap stacks look, at most one step in this many records them (a measurement is noisy).
pub const MIN_EVERY: u32 = 4;
/// However dear, at least one in this many: a sampled step stays in the ring buffer.
pub const MAX_EVERY: u32 = 50;
/// The share of the run that the sampled steps' extra time may take.
pub const STACK_BUDGET: f64 = 0.01;
/// Step marks kept (16 bytes each): far more steps than the ring buffer holds events of.
pub const MAX_MARKS: usize = 200_000;
/// Recent step times kept for the estimate.
const TIMED: usize = 16;
/// Sampled steps whose overhead the estimate takes the median of.
const OVERHEADS: usize = 3;

/// The sampler of one process (kept in a [`crate::fork::PerProcess`]: a forked child's
/// recording is its own).
#[derive(Debug)]
pub struct StackSampler {
    /// `gpuexp.config(trace_sampling=)` as the first open experiment found it: False records
    /// stacks on every step.
    enabled: bool,
    /// Traced experiments open now.
    experiments: usize,
    /// The kind of step end followed: the first one seen (an optimizer step inside a trainer's
    /// step would otherwise cut every step in two).
    followed: Option<StepKind>,
    /// The stretch since the last step end records stacks.
    stacks: bool,
    /// Steps begun since the last sampled one began.
    since_sampled: u32,
    every: u32,
    /// The stretch from the opening to the first step end: never timed (it may hold setup).
    first_stretch: bool,
    last_end_us: Option<i64>,
    /// Recent durations of steps without stacks, microseconds.
    plain_us: VecDeque<i64>,
    /// Recent sampled steps' extra time, as a share of a step without stacks.
    overheads: VecDeque<f64>,
    marks: VecDeque<StepMark>,
}

impl StackSampler {
    pub const fn new() -> StackSampler {
        StackSampler {
            enabled: true,
            experiments: 0,
            followed: None,
            stacks: true,
            since_sampled: 0,
            every: DEFAULT_EVERY,
            first_stretch: true,
            last_end_us: None,
            plain_us: VecDeque::new(),
            overheads: VecDeque::new(),
            marks: VecDeque::new(),
        }
    }

    /// A traced experiment opens at `now_us` with its recording's stacks on. The first one
    /// starts the schedule (`enabled`: `trace_sampling`, else stacks on every step): its first
    /// step is sampled.
    pub fn begin(&mut self, now_us: i64, enabled: bool) {
        self.experiments += 1;
        if self.experiments > 1 {
            return;
        }
        self.enabled = enabled;
        self.followed = None;
        self.stacks = true;
        self.since_sampled = 0;
        self.first_stretch = true;
        self.last_end_us = Some(now_us);
        self.mark(now_us, Recorded::Stacks);
    }

    /// A traced experiment finishes at `now_us`. Returns true when it was the last one and its
    /// recording runs without stacks now: the binding gives them back to the clients left.
    pub fn end(&mut self, now_us: i64) -> bool {
        if self.experiments == 0 {
            return false;
        }
        self.experiments -= 1;
        if self.experiments > 0 {
            return false;
        }
        self.mark(now_us, Recorded::Outside);
        let restore = !self.stacks;
        self.stacks = true;
        restore
    }

    pub fn active(&self) -> bool {
        self.experiments > 0
    }

    /// A step of `kind` ended at `now_us`. Decides whether the next step records stacks: where
    /// that differs from now it returns what to switch to, and the binding switches the
    /// recording (without this lock held: the switch runs Python) and tells `switched` what it
    /// records then; otherwise the step's mark is taken now. A cell's end is no training step.
    pub fn step_ended(&mut self, kind: StepKind, now_us: i64) -> Option<bool> {
        if !self.active() || kind == StepKind::Cell || self.followed.is_some_and(|followed| followed != kind) {
            return None;
        }
        self.followed = Some(kind);
        if let Some(last) = self.last_end_us {
            self.timed(now_us - last);
        }
        self.first_stretch = false;
        self.last_end_us = Some(now_us);
        self.since_sampled += 1;
        let wanted = !self.enabled || self.since_sampled >= self.every;
        if wanted {
            self.since_sampled = 0;
        }
        if wanted != self.stacks {
            return Some(wanted);
        }
        self.switched(now_us, wanted);
        None
    }

    /// The step that ended at `now_us` was followed by a switch: the recording records `stacks`
    /// now (a failed switch leaves it as it was).
    pub fn switched(&mut self, now_us: i64, stacks: bool) {
        self.stacks = stacks;
        self.mark(now_us, if stacks { Recorded::Stacks } else { Recorded::Events });
    }

    /// The step that just ended took `duration_us`: a step without stacks joins the baseline,
    /// a sampled one gives the stacks' overhead, and `every` follows it.
    fn timed(&mut self, duration_us: i64) {
        if duration_us <= 0 {
            return;
        }
        if !self.stacks {
            push_capped(&mut self.plain_us, duration_us, TIMED);
            return;
        }
        if self.first_stretch || self.plain_us.is_empty() {
            return;
        }
        let mut plain: Vec<i64> = self.plain_us.iter().copied().collect();
        plain.sort_unstable();
        let baseline = plain[plain.len() / 2] as f64;
        push_capped(&mut self.overheads, duration_us as f64 / baseline - 1.0, OVERHEADS);
        let mut overheads: Vec<f64> = self.overheads.iter().copied().collect();
        overheads.sort_by(f64::total_cmp);
        let overhead = overheads[overheads.len() / 2].max(0.0);
        // Less a hair: 0.3 / 0.01 is 30.000000000000004 in floats.
        let steps = (overhead / STACK_BUDGET - 1e-9).ceil();
        self.every = if steps >= f64::from(MAX_EVERY) { MAX_EVERY } else { (steps as u32).max(MIN_EVERY) };
    }

    fn mark(&mut self, time_us: i64, recorded: Recorded) {
        push_capped(&mut self.marks, StepMark { time_us, recorded }, MAX_MARKS);
    }

    /// Every step end and opening kept, oldest first: what the replay splits the trace by.
    pub fn marks(&self) -> Vec<StepMark> {
        self.marks.iter().copied().collect()
    }

    /// One step in how many records stacks now.
    pub fn every(&self) -> u32 {
        self.every
    }
}

impl Default for StackSampler {
    fn default() -> StackSampler {
        StackSampler::new()
    }
}

fn push_capped<T>(queue: &mut VecDeque<T>, item: T, cap: usize) {
    if queue.len() == cap {
        queue.pop_front();
    }
    queue.push_back(item);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A step end, its switch carried out by `switch` (which says what the recording does then).
    fn step(sampler: &mut StackSampler, kind: StepKind, now: i64, switch: impl FnOnce(bool) -> bool) {
        if let Some(wanted) = sampler.step_ended(kind, now) {
            sampler.switched(now, switch(wanted));
        }
    }

    /// Runs `steps` optimizer steps of `step_us` each (`sampled_us` where stacks are on), each
    /// switch carried out; returns which steps after the first recorded stacks.
    fn run(sampler: &mut StackSampler, steps: usize, plain_us: i64, sampled_us: i64) -> Vec<bool> {
        let mut now = sampler.marks().last().map_or(0, |m| m.time_us);
        (0..steps)
            .map(|_| {
                now += if sampler.stacks { sampled_us } else { plain_us };
                step(sampler, StepKind::OptimizerStep, now, |stacks| stacks);
                sampler.stacks
            })
            .collect()
    }

    #[test]
    fn the_first_step_records_stacks_then_one_in_every() {
        let mut sampler = StackSampler::new();
        sampler.begin(1_000, true);
        assert!(sampler.stacks, "the step after the opening records stacks");
        let sampled = run(&mut sampler, 2 * DEFAULT_EVERY as usize, 1_000, 1_000);
        let at: Vec<usize> = sampled.iter().enumerate().filter(|(_, s)| **s).map(|(i, _)| i + 2).collect();
        // Steps are numbered from 1 at the opening; step 1 was sampled, then 11 (cheap stacks: every drops to 4).
        assert_eq!(at[0], 1 + DEFAULT_EVERY as usize);
        assert_eq!(sampler.every(), MIN_EVERY, "a sampled step no slower than the rest gives the least spacing");
        assert_eq!(at[1] - at[0], MIN_EVERY as usize);
        assert!(sampler.marks().iter().any(|m| m.recorded == Recorded::Events));
    }

    #[test]
    fn dear_stacks_space_the_sampled_steps_out_to_stay_in_budget() {
        let mut sampler = StackSampler::new();
        sampler.begin(0, true);
        // Stacks and hooks make a step 30% slower: one step in 30 keeps them at 1% of the run.
        run(&mut sampler, 3 * DEFAULT_EVERY as usize, 10_000, 13_000);
        assert_eq!(sampler.every(), 30);
        // Twice as slow: capped, so a sampled step stays in the ring buffer.
        run(&mut sampler, 200, 10_000, 20_000);
        assert_eq!(sampler.every(), MAX_EVERY);
    }

    #[test]
    fn without_a_step_end_stacks_stay_on_and_a_cell_end_is_no_step() {
        let mut sampler = StackSampler::new();
        sampler.begin(0, true);
        step(&mut sampler, StepKind::Cell, 10, |_| panic!("a cell's end switches nothing"));
        assert!(sampler.stacks);
        assert_eq!(sampler.marks(), vec![StepMark { time_us: 0, recorded: Recorded::Stacks }]);
        assert!(!sampler.end(20), "stacks are on: nothing to give back");
        assert_eq!(sampler.marks().last().map(|m| m.recorded), Some(Recorded::Outside));
    }

    #[test]
    fn the_first_kind_of_step_end_is_followed_and_others_ignored() {
        let mut sampler = StackSampler::new();
        sampler.begin(0, true);
        step(&mut sampler, StepKind::OptimizerStep, 10, |stacks| stacks);
        step(&mut sampler, StepKind::TrainerStep, 11, |_| panic!("a trainer's step inside is no second step"));
        assert_eq!(sampler.marks().len(), 2);
    }

    #[test]
    fn turned_off_it_keeps_stacks_on_every_step_and_still_marks_them() {
        let mut sampler = StackSampler::new();
        sampler.begin(0, false);
        let sampled = run(&mut sampler, 30, 1_000, 1_300);
        assert!(sampled.iter().all(|s| *s));
        assert!(sampler.marks().iter().all(|m| m.recorded == Recorded::Stacks));
        assert_eq!(sampler.marks().len(), 31);
    }

    #[test]
    fn a_failed_switch_is_recorded_as_it_really_ran_and_the_last_end_gives_stacks_back() {
        let mut sampler = StackSampler::new();
        sampler.begin(0, true);
        step(&mut sampler, StepKind::OptimizerStep, 10, |_| true);
        assert_eq!(sampler.marks()[1].recorded, Recorded::Stacks, "the switch failed: stacks still on");
        step(&mut sampler, StepKind::OptimizerStep, 20, |stacks| stacks);
        assert_eq!(sampler.marks()[2].recorded, Recorded::Events);
        // A nested experiment: only the outer one's end gives stacks back.
        sampler.begin(25, true);
        assert!(!sampler.end(30));
        assert!(sampler.end(40));
        assert!(!sampler.active());
        step(&mut sampler, StepKind::OptimizerStep, 50, |_| panic!("no experiment open"));
    }
}
