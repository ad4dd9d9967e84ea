use super::*;

const MIB: u64 = 1 << 20;

pub(super) fn settings(usable: u64) -> Settings {
    Settings {
        start: 8,
        max: 4096,
        usable,
        margin: 0.0,
        power_of_two: false,
        multiple_of: 1,
        verifications: 2,
        steps_per_trial: 2,
    }
}

/// Runs a search against a model of the step: `peak(batch)` bytes, and an OOM above `capacity`.
fn run(settings: Settings, capacity: u64, peak: impl Fn(u64) -> u64) -> Search {
    run_reserving(settings, capacity, &peak, &peak)
}

/// As `run`, where torch reserves `reserved(batch)` and runs out of memory when that is over `capacity`.
fn run_reserving(
    settings: Settings,
    capacity: u64,
    peak: &dyn Fn(u64) -> u64,
    reserved: &dyn Fn(u64) -> u64,
) -> Search {
    let mut search = Search::new(settings).unwrap();
    for _ in 0..100 {
        match search.next_trial() {
            Next::Done => return search,
            Next::Try(batch, role) => {
                let outcome = if reserved(batch) > capacity {
                    Outcome::OutOfMemory
                } else {
                    Outcome::Fit { peak: peak(batch), reserved: reserved(batch) }
                };
                search.record(Trial { batch, outcome, seconds: 0.1, role });
            }
        }
    }
    panic!("the search did not end: {search:?}")
}

fn true_max(budget: u64, peak: impl Fn(u64) -> u64) -> u64 {
    (1..=4096).take_while(|b| peak(*b) <= budget).last().unwrap_or(0)
}

#[test]
fn a_linear_model_is_found_in_five_trials() {
    let budget = 24 << 30;
    let peak = |b: u64| 2 * (1 << 30) + b * 90 * MIB;
    let search = run(settings(budget), 26 << 30, peak);
    assert_eq!(search.trials.len(), 5, "{search:?}");
    assert_eq!(search.linear, Some(true));
    assert_eq!(search.batch_size, Some(true_max(budget, peak)));
}

#[test]
fn a_prediction_that_overshoots_is_bisected_down() {
    // Superlinear: the line from small probes predicts too high.
    let budget = 8 << 30;
    let peak = |b: u64| (1 << 30) + b * 20 * MIB + b * b * 64 * 1024;
    let search = run(settings(budget), 10 << 30, peak);
    let truth = true_max(budget, peak);
    let found = search.batch_size.unwrap();
    assert!(found <= truth && found as f64 >= truth as f64 * 0.95, "found {found}, true {truth}: {search:?}");
    assert!(search.trials.iter().any(|t| t.role == Role::Bisect));
}

#[test]
fn an_oom_at_the_prediction_falls_back_to_bisection() {
    // The budget is optimistic: the device runs out before the budget is reached.
    let peak = |b: u64| (1 << 30) + b * 100 * MIB;
    let search = run(settings(40 << 30), 20 << 30, peak);
    let (found, truth) = (search.batch_size.unwrap(), true_max(20 << 30, peak));
    assert!(found <= truth && found as f64 >= truth as f64 * 0.99, "found {found}, true {truth}: {search:?}");
}

#[test]
fn bisection_stops_within_one_percent_of_the_edge_and_holds_the_margin_back() {
    // As a small conv net at a 4 GiB cap on an H200: its few large activations fragment the
    // cap, and 320 failed where the line of allocated peaks put the edge near 390.
    let peak = |b: u64| 75 * MIB + b * 10 * MIB;
    let mut s = settings(4 << 30);
    s.margin = 0.02;
    let search = run(s, peak(314), peak);
    let found = search.batch_size.unwrap();
    // The edge is found within 1%, then 2% of it is held back.
    assert!((299..=308).contains(&found), "{search:?}");
    let edge = search.bounds().0.unwrap();
    assert!((311..=314).contains(&edge) && found == edge * 98 / 100, "{search:?}");
    assert!(search.verdict.contains("2% held back") && search.trials.len() <= 12, "{search:?}");
}

#[test]
fn the_held_back_size_runs_before_it_is_the_answer_and_a_failure_there_is_a_new_edge() {
    // As a small transformer under 4 GiB on an H100: 694 ran and 700 did not, but 680 (694
    // less 2%), where other kernels were picked, ran out of memory.
    let peak = |b: u64| 75 * MIB + b * 10 * MIB;
    let mut s = settings(4 << 30);
    s.margin = 0.02;
    let smooth = run(s.clone(), peak(314), peak);
    let held_back = smooth.batch_size.unwrap();
    let ran = |search: &Search, batch: u64| {
        search.trials.iter().any(|t| t.batch == batch && matches!(t.outcome, Outcome::Fit { .. }))
    };
    assert!(ran(&smooth, held_back), "the answer ran: {smooth:?}");
    assert_eq!(smooth.trials.last().map(|t| t.role), Some(Role::HeldBack));

    let spike = |b: u64| if b == held_back { 8 << 30 } else { peak(b) };
    let search = run_reserving(s, peak(314), &peak, &spike);
    let found = search.batch_size.unwrap();
    assert!(found < held_back && ran(&search, found), "{search:?}");
    assert!(search.trials.iter().any(|t| t.batch == held_back && t.outcome == Outcome::OutOfMemory));
    assert!(found >= held_back * 96 / 100, "{search:?}");
}

#[test]
fn a_prediction_a_few_mib_over_the_budget_still_fits() {
    // As the bench's conv net on an H200: the line through 16 and 666 put 1285 at the 23.35
    // GiB budget, and its peak was 10 MiB over. It ran, well inside the margin.
    let peak = |b: u64| 200 * MIB + b * 18 * MIB + b * b * 20;
    let mut s = settings(24 << 30);
    s.margin = 0.02;
    let search = run(s, 24 << 30, peak);
    let over = search
        .trials
        .iter()
        .any(|t| matches!(t.outcome, Outcome::Fit { peak, .. } if t.role == Role::Verify && peak > search.budget()));
    assert!(over, "the model should overshoot the budget a little: {search:?}");
    assert_eq!(search.trials.len(), 5, "{search:?}");
    assert_eq!(search.batch_size, search.predicted, "{search:?}");
}

#[test]
fn what_torch_keeps_cached_whatever_the_batch_is_held_back() {
    // As a small transformer at a 4 GiB cap on an H200: torch reserved about 170 MiB more than
    // its peak at every size, so the line of allocated peaks alone predicted an OOM.
    let peak = |b: u64| 100 * MIB + b * 5488 * 1024;
    let reserved = |b: u64| peak(b) + 170 * MIB;
    let mut s = settings(4 << 30);
    s.margin = 0.02;
    let search = run_reserving(s, 4 << 30, &peak, &reserved);
    let truth = true_max(4 << 30, reserved);
    let found = search.batch_size.unwrap();
    assert!(found <= truth && found as f64 >= truth as f64 * 0.95, "found {found}, true {truth}: {search:?}");
    assert_eq!(search.trials.len(), 5, "{search:?}");
}

#[test]
fn rounding_to_powers_of_two_and_multiples() {
    let peak = |b: u64| (1 << 30) + b * 10 * MIB;
    let mut s = settings(4 << 30);
    s.power_of_two = true;
    let search = run(s.clone(), 5 << 30, peak);
    assert_eq!(search.batch_size, Some(256), "{search:?}"); // the true max is 307
    s.power_of_two = false;
    s.multiple_of = 24;
    assert_eq!(run(s, 5 << 30, peak).batch_size, Some(288));
}

#[test]
fn max_caps_the_answer_and_a_start_that_does_not_fit_says_so() {
    let mut s = settings(64 << 30);
    s.max = 100;
    let search = run(s, 80 << 30, |b| b * MIB);
    assert_eq!(search.batch_size, Some(100));
    assert!(search.verdict.contains("max=100"));
    let tiny = run(settings(1 << 20), 2 << 20, |b| b * 10 * MIB);
    assert_eq!(tiny.batch_size, None);
    assert!(tiny.verdict.contains("even batch size 1 does not fit"), "{}", tiny.verdict);
    // it bisected below start
}

#[test]
fn fixed_costs_of_small_batches_do_not_skew_the_prediction() {
    // As measured on an H100: small batches pay extra per sample (allocator rounding,
    // workspaces), so a line through 8 and 16 alone predicts far too low.
    let peak = |b: u64| (60 * MIB) + b * 18 * MIB + b.min(16) * 10 * MIB;
    let search = run(settings(24 << 30), 24 << 30, peak); // under a limit: no margin

    let (found, truth) = (search.batch_size.unwrap() as f64, true_max(24 << 30, peak) as f64);
    assert!(found >= truth * 0.95 && found <= truth, "found {found}, true {truth}: {search:?}");
    assert_eq!(search.trials.len(), 5, "{search:?}");
}

#[test]
fn a_prediction_just_over_the_edge_steps_down_instead_of_bisecting() {
    // The line is right, but the device fails about 1% below what it predicts (rounding at
    // a cap), as seen on an H100: 1320 predicted, 1318 the largest that ran.
    let peak = |b: u64| (1 << 30) + b * 16 * MIB;
    let search = run(settings(24 << 30), peak(1458), peak);
    let found = search.batch_size.unwrap();
    assert!((1414..=1458).contains(&found), "{search:?}");
    assert!(search.trials.len() <= 7 && !search.trials.iter().any(|t| t.role == Role::Bisect), "{search:?}");
}

#[test]
fn a_size_that_failed_once_is_never_the_answer() {
    let mut search = Search::new(settings(8 << 30)).unwrap();
    let fit = |p| Outcome::Fit { peak: p, reserved: p };
    for (batch, outcome) in [(8, fit(MIB)), (16, fit(2 * MIB)), (378, fit(7 << 30)), (378, Outcome::OutOfMemory)] {
        search.record(Trial { batch, outcome, seconds: 0.1, role: Role::Verify });
    }
    assert_eq!(search.bounds(), (Some(16), Some(378)));
}

#[test]
fn the_margin_costs_at_most_its_share_of_the_batch_size() {
    // 6 GiB of weights and optimizer state, 20 MiB a sample, 24 GiB usable.
    let peak = |b: u64| (6 << 30) + b * 20 * MIB;
    let mut s = settings(24 << 30);
    s.margin = 0.05;
    let found = run(s, 24 << 30, peak).batch_size.unwrap() as f64;
    let truth = true_max(24 << 30, peak) as f64;
    assert!(found >= truth * 0.949 && found < truth, "found {found}, true {truth}");
}

#[test]
fn the_table_shows_every_trial_and_the_fit() {
    let search = run(settings(24 << 30), 26 << 30, |b| 2 * (1 << 30) + b * 90 * MIB);
    let text = search.grid().to_text();
    assert!(text.contains("batch size 250 · 5 trials") && text.contains("linear (checked"), "{text}");
    assert_eq!(text.matches("verify").count(), 2, "{text}");
}

#[test]
fn bad_settings_are_refused_with_the_fix() {
    let refused = |s: &Settings, fix: &str| {
        let error = Search::new(s.clone()).unwrap_err();
        assert!(matches!(&error, Error::InvalidArgument(m) if m.contains(fix)), "{error:?}");
    };
    let mut s = settings(1);
    s.start = 0;
    refused(&s, "start must be at least 1");
    s.start = 8;
    s.multiple_of = 0;
    refused(&s, "multiple_of");
    s.multiple_of = 1;
    s.steps_per_trial = 0;
    refused(&s, "steps=2");
}
