//! Sampled stacks in the replay: scripted training steps, some recorded with stacks and some
//! without, whose every block's true site is known. The peak and its rows stay exact to the
//! byte; the blocks of the steps without stacks get their true sites from the sampled step.

use std::collections::HashMap;

use super::sampling::StackCost;
use super::tests::{attribution, Program};
use super::*;

const USER: &str = "/home/u/train.py";

/// The stacks a step's lines are recorded with.
struct Lines {
    forward: StackId,
    scores: StackId,
    extra: StackId,
    keep: StackId,
    backward: StackId,
    optimizer: StackId,
}

fn lines(p: &mut Program) -> Lines {
    Lines {
        forward: p.line(10),
        scores: p.line(14),
        extra: p.line(16),
        keep: p.line(30),
        backward: p.stack(&[
            ("/usr/lib/python3.11/site-packages/torch/autograd/__init__.py", 200, "backward"),
            (USER, 20, "step"),
        ]),
        optimizer: p
            .stack(&[("/usr/lib/python3.11/site-packages/torch/optim/adam.py", 90, "step"), (USER, 22, "step")]),
    }
}

/// One training step: recorded with its stacks, or without any (as torch records it with
/// `context=None`); `extra` allocates one more block of that size, kept, after the scores. Each
/// step keeps a block at line 30, so the last step peaks highest.
fn step(p: &mut Program, at: &Lines, stacks: bool, extra: Option<u64>) {
    let s = |stack: StackId| if stacks { stack } else { 0 };
    let x = p.alloc(64_000, s(at.forward), &format!("{USER}:10"));
    let scores = p.alloc(4_096_000, s(at.scores), &format!("{USER}:14"));
    if let Some(extra) = extra {
        p.alloc(extra, s(at.extra), &format!("{USER}:16"));
    }
    p.alloc(1 << 20, s(at.keep), &format!("{USER}:30"));
    // Autograd's thread records no frames; the last stack before it says "backward".
    p.event(Action::AllocationHistory, s(at.backward));
    let gradient = p.alloc(2 << 20, 0, "backward");
    p.free(scores);
    p.free(x);
    let temporary = p.alloc(512_000, s(at.optimizer), &format!("{USER}:22"));
    p.free(temporary);
    p.free(gradient);
}

/// The end of the events so far, plus a little: when a step mark is taken.
fn now(p: &Program) -> i64 {
    p.events.last().map_or(0, |event| event.time_us) + 5
}

/// Weights from before the window, then `steps` steps (true: with stacks), each with its
/// `extra`; the step marks as gpuexp's sampler takes them.
fn sampled_run(steps: &[(bool, Option<u64>)]) -> (AllocationHistory, Vec<u64>, Vec<HashMap<String, u64>>) {
    let mut p = Program::new();
    let at = lines(&mut p);
    let init =
        p.stack(&[("/usr/lib/python3.11/site-packages/torch/nn/modules/module.py", 900, "_apply"), (USER, 3, "main")]);
    p.alloc(8 << 20, init, &format!("{USER}:3"));
    let mut marks = Vec::new();
    for (n, &(stacks, extra)) in steps.iter().enumerate() {
        let recorded = if stacks { Recorded::Stacks } else { Recorded::Events };
        // The opening's mark, then each step end's with what the next step records.
        marks.push(StepMark { time_us: now(&p), recorded });
        step(&mut p, &at, stacks, extra);
        assert!(n < steps.len());
    }
    let (mut snapshot, truth, by_site) = p.snapshot(0);
    snapshot.gpuexp.steps = Some(marks);
    (snapshot, truth, by_site)
}

/// The peak's rows against the truth, label by label; returns the table.
fn peak_against_truth(snapshot: &AllocationHistory, truth: &[u64], by_site: &[HashMap<String, u64>]) -> PeakSites {
    let (rule, namer) = (SiteRule::default(), PlainNamer::default());
    let replayed = replay(snapshot, 0, None);
    let sites = peak_sites(&replayed, &attribution(snapshot, &rule, &namer), 20);
    let at = replayed.peak.event.expect("a peak in the trace");
    assert_eq!(sites.peak.bytes, *truth.iter().max().unwrap(), "the peak is torch's to the byte");
    assert_eq!(sites.table.total, truth[at], "the rows add up to the peak");
    let true_sites = &by_site[at];
    for row in sites.table.all.iter().filter(|row| !row.label.starts_with("(unattributed")) {
        let label = if row.label.starts_with("backward at") { "backward" } else { row.label.as_str() };
        assert_eq!(Some(&row.bytes), true_sites.get(label), "{}: truth {true_sites:?}", row.label);
    }
    sites
}

#[test]
fn blocks_of_steps_without_stacks_take_the_sampled_steps_sites_and_the_peak_stays_exact() {
    let (snapshot, truth, by_site) = sampled_run(&[(true, None), (false, None), (false, None), (false, None)]);
    let sites = peak_against_truth(&snapshot, &truth, &by_site);
    let sampling = sites.sampling.clone().expect("gpuexp's step marks");
    assert_eq!((sampling.steps, sampling.with_stacks), (4, 1));
    assert_eq!(sampling.unattributed_bytes, 0);
    assert_eq!(sampling.sites_from_steps, vec![1]);
    // At the last step's peak: the weights and step 1's kept block are its own; the rest mapped.
    assert_eq!(sampling.direct_bytes, (8 << 20) + (1 << 20));
    assert_eq!(sampling.direct_bytes + sampling.mapped_bytes, sites.table.total);
    let text = sites.to_text();
    assert!(text.contains("attribution sampled: Python stacks on 1 of 4 steps"), "{text}");
    assert!(text.contains("mapped from step 1"), "{text}");
    let json = sites.to_json();
    assert_eq!(json["sampling"]["with_stacks"], 1);
    assert_eq!(json["sampling"]["mapped_bytes"], sampling.mapped_bytes);
    // The backward block of the last step (no stacks) goes by the sampled step's phase too.
    assert!(sites.table.all.iter().any(|row| row.label == "backward at /home/u/train.py:20" && row.blocks == 1));
}

#[test]
fn a_block_no_sampled_step_made_is_unattributed_and_the_order_after_it_realigns() {
    // Step 3 makes a block of a size the sampled steps never made, before its kept block.
    let (snapshot, truth, by_site) =
        sampled_run(&[(true, None), (false, None), (false, Some(3 << 20)), (true, None), (false, None)]);
    let sites = peak_against_truth(&snapshot, &truth, &by_site);
    let sampling = sites.sampling.clone().unwrap();
    assert_eq!((sampling.steps, sampling.with_stacks), (5, 2));
    assert_eq!(sampling.unattributed_bytes, 3 << 20, "only the new block");
    let unattributed = sites.table.all.iter().find(|row| row.label.starts_with("(unattributed")).expect("its row");
    assert_eq!(unattributed.bytes, 3 << 20);
    assert!(sites.table.categories.iter().any(|c| c.category.starts_with("unattributed") && c.bytes == 3 << 20));
    // Step 5 maps from step 4, the latest sampled one before it; steps 2 and 3 from step 1.
    assert_eq!(sampling.sites_from_steps, vec![1, 4]);
    assert!(sites.to_text().contains("3.00 MiB unattributed"), "{}", sites.to_text());
}

#[test]
fn a_sampled_step_with_an_extra_block_still_maps_the_steps_after_it_by_size() {
    // The sampled step allocates one more block (an optimizer's state on its first step, say).
    let (snapshot, truth, by_site) = sampled_run(&[(true, Some(3 << 20)), (false, None), (false, None)]);
    let sites = peak_against_truth(&snapshot, &truth, &by_site);
    assert_eq!(sites.sampling.unwrap().unattributed_bytes, 0);
}

#[test]
fn without_a_step_end_the_trace_is_full_and_without_gpuexps_marks_nothing_is_said() {
    let (snapshot, truth, by_site) = sampled_run(&[(true, None)]);
    let sites = peak_against_truth(&snapshot, &truth, &by_site);
    let sampling = sites.sampling.clone().unwrap();
    assert!(sampling.full());
    assert_eq!(sampling.mapped_bytes + sampling.unattributed_bytes, 0);
    assert!(sites.to_text().contains("attribution: full, Python stacks on every allocation"), "{}", sites.to_text());
    // Every step with stacks (`trace_sampling=False`): full too, the steps counted.
    let (snapshot, truth, by_site) = sampled_run(&[(true, None), (true, None), (true, None)]);
    let sites = peak_against_truth(&snapshot, &truth, &by_site);
    assert!(sites.to_text().contains("attribution: full, Python stacks on all 3 steps"), "{}", sites.to_text());
    // A torch snapshot from elsewhere carries no marks: no line about sampling.
    let (mut snapshot, truth, by_site) = sampled_run(&[(true, None), (true, None)]);
    snapshot.gpuexp.steps = None;
    assert_eq!(peak_against_truth(&snapshot, &truth, &by_site).sampling, None);
}

#[test]
fn a_window_counts_only_its_own_steps_and_the_marks_after_the_last_experiment_are_outside() {
    let (mut snapshot, _, _) = sampled_run(&[(true, None), (false, None), (false, None)]);
    let marks = snapshot.gpuexp.steps.as_mut().unwrap();
    let second = marks[1].time_us;
    let end = snapshot.device_traces[0].last().unwrap().time_us + 1;
    marks.push(StepMark { time_us: end, recorded: Recorded::Outside });
    let replayed = replay(&snapshot, 0, None);
    assert_eq!(replayed.steps.len(), 4);
    let live = replayed.live_at_peak();
    let from_second = sampling::summary(&replayed, second, &live).unwrap();
    assert_eq!((from_second.steps, from_second.with_stacks), (2, 0));
    // The sampled step was before this window: its number says so (0).
    assert_eq!(from_second.sites_from_steps, vec![0]);
}

#[test]
fn the_report_states_what_the_stacks_cost_this_run_from_its_own_step_times() {
    // Steps of 10 ms without stacks, one of 13 ms with: +30% a sampled step, 3 ms of 43 ms.
    let cost = StackCost::measure(&[(10_000, false), (13_000, true), (10_000, false), (10_000, false)]).unwrap();
    assert!((cost.per_sampled_step - 0.30).abs() < 1e-9, "{cost:?}");
    assert!((cost.of_the_run - 3.0 / 43.0).abs() < 1e-9, "{cost:?}");
    assert_eq!(StackCost::measure(&[(10_000, false), (10_000, false)]), None, "no sampled step timed");
    let sampling = Sampling {
        steps: 5,
        with_stacks: 2,
        direct_bytes: 0,
        mapped_bytes: 0,
        unattributed_bytes: 0,
        sites_from_steps: vec![],
        cost: Some(cost),
    };
    let text = sampling.describe();
    assert!(text.contains("a step with stacks took +30% and the sampled steps +7.0% of the run"), "{text}");
}
