//! The search seeded by estimates: the step's peak, predicted under fake tensors at a few batch
//! sizes (`gpuexp.estimate`), gives the line before any real trial. The real trials then only
//! place the answer: one a little below the predicted size, where an estimate a few percent low
//! still fits, and one at the size its exact measurement corrects to.

use std::time::Instant;

use serde::Serialize;

use super::{Line, Next, Outcome, Role, Search};
use crate::units::bytes;

/// What the estimates predicted before any real trial.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Seed {
    /// (batch size, predicted torch peak allocated in bytes), in the order they were estimated.
    pub estimates: Vec<(u64, u64)>,
    pub seconds: f64,
}

/// Where the first real trial runs, as a share of the predicted size: the estimates fall short
/// of the measured peak by up to about 5% (a conv net's cuDNN workspaces), and a trial there
/// measures what the correction needs while extrapolating little.
const FIRST_TRIAL_SHARE: f64 = 0.9;
/// A correction that gains less than this share of the size is not worth a further trial.
const WORTH_A_TRIAL: f64 = 0.01;
/// Estimates stop once the prediction moves less than this share, or after `MOST_ESTIMATES`.
const SETTLED: f64 = 0.01;
const MOST_ESTIMATES: usize = 5;
/// Past this many real trials the seeded search hands over to bisection.
const MOST_SEEDED_TRIALS: usize = 4;

/// The line through the estimate at the largest size and one well below it: small sizes carry
/// fixed costs (the allocator's rounding, workspaces) that a line through them overstates, and
/// two sizes a few apart (an H100 transformer at 69 and 71) tilt it with the allocator's rounding.
fn line_through_largest(estimates: &[(u64, u64)]) -> Option<Line> {
    let mut sorted = estimates.to_vec();
    sorted.sort_unstable();
    sorted.dedup_by_key(|(batch, _)| *batch);
    let (&(b2, p2), below) = sorted.split_last()?;
    let &(b1, p1) = below.iter().rev().find(|(batch, _)| batch * 4 <= b2 * 3).or(below.last())?;
    let slope = (p2 as f64 - p1 as f64) / (b2 as f64 - b1 as f64);
    Some(Line { intercept: p1 as f64 - slope * b1 as f64, slope })
}

impl Search {
    /// The largest size `line` puts under the budget, the budget's margin taken from `line`.
    fn predicted_by(&self, line: Line) -> u64 {
        if line.slope <= 0.0 {
            return self.round(self.settings.max);
        }
        let mut with_line = self.clone();
        with_line.line = Some(line);
        with_line.predict(line)
    }

    /// The next batch size to estimate, given those estimated so far; None once the predicted
    /// size has settled.
    pub fn next_estimate(&self, estimates: &[(u64, u64)]) -> Option<u64> {
        let start = self.settings.start;
        let second = (start * 4).min(self.settings.max);
        match estimates.len() {
            0 => return Some(start),
            1 => return (second > start).then_some(second),
            n if n >= MOST_ESTIMATES => return None,
            _ => {}
        }
        let predicted = self.predicted_by(line_through_largest(estimates)?);
        let last = estimates.last().map_or(0, |(batch, _)| *batch);
        let settled = estimates.len() > 2 && (predicted as f64 - last as f64).abs() <= last as f64 * SETTLED;
        let known = estimates.iter().any(|(batch, _)| *batch == predicted);
        (predicted > 0 && !settled && !known).then_some(predicted)
    }

    /// Starts the search from estimates of the step: `estimate(batch)` answers the predicted
    /// torch peak at `batch` and the calls it ran, and `progress` is given a line on each.
    /// `started`: when preparing them began. An estimate that fails leaves the search to its
    /// trials, and its table says why.
    pub fn seed_by<E: std::fmt::Display>(
        &mut self,
        started: Instant,
        mut estimate: impl FnMut(u64) -> Result<(u64, u32), E>,
        mut progress: impl FnMut(String) -> Result<(), E>,
    ) {
        let mut estimates = Vec::new();
        while let Some(batch) = self.next_estimate(&estimates) {
            let at = Instant::now();
            let answered = estimate(batch).and_then(|(peak, calls)| {
                let seconds = at.elapsed().as_secs_f64();
                let line = format!(
                    "gpuexp: estimate at batch size {batch}: torch peak {} ({calls} calls under fake tensors, {seconds:.2} s)",
                    bytes(peak)
                );
                progress(line).map(|()| peak)
            });
            match answered {
                Ok(peak) => estimates.push((batch, peak)),
                Err(error) => {
                    self.unseeded = Some(format!("{error}; searched by trials"));
                    return;
                }
            }
        }
        self.seed(Seed { estimates, seconds: started.elapsed().as_secs_f64() });
    }

    /// Starts the search from the estimates: their line and the size it predicts.
    pub fn seed(&mut self, seed: Seed) {
        self.predicted = Some(match line_through_largest(&seed.estimates) {
            Some(line) => {
                self.line = Some(line);
                self.predicted_by(line)
            }
            // One size only (start = max): it is the answer if its estimate is under the budget.
            None => seed.estimates.first().filter(|(_, peak)| *peak <= self.budget()).map_or(0, |(batch, _)| *batch),
        });
        self.seed = Some(seed);
    }

    /// The size a trial's exact peak corrects to with the estimated slope: the slope is what
    /// the estimate gets right; what it misses (workspaces, the allocator's cache) is in the peak.
    fn corrected(&self, batch: u64, peak: u64) -> u64 {
        let slope = self.line.map_or(0.0, |line| line.slope);
        if slope <= 0.0 {
            return self.round(self.settings.max);
        }
        let size = batch as f64 + (self.budget() as f64 - peak as f64) / slope;
        if size < 1.0 {
            0
        } else {
            self.round(size.floor() as u64)
        }
    }

    pub(super) fn next_seeded(&mut self) -> Next {
        let predicted = self.predicted.unwrap_or(0);
        if predicted == 0 {
            // The estimates leave no room for a single sample: the trials say whether that is so.
            self.unseeded = Some("the estimates predict that no batch size fits; searched by trials".into());
            self.seed = None;
            self.line = None;
            self.predicted = None;
            return self.next_trial();
        }
        let Some(last) = self.trials.last().copied() else {
            let first = if predicted >= self.round(self.settings.max) {
                predicted
            } else {
                self.round((predicted as f64 * FIRST_TRIAL_SHARE) as u64).max(1)
            };
            return Next::Try(first, Role::FromEstimate);
        };
        let (good, bad) = self.bounds();
        let placed = |search: &mut Search| {
            let trials = search.trials.len();
            search.finish(format!(
                "the estimates predicted {predicted}; {trials} real trial{} placed the answer",
                if trials == 1 { "" } else { "s" }
            ))
        };
        // A corrected size that fits is the answer: it was aimed at the budget.
        if last.role == Role::Corrected && self.fits(&last) {
            return placed(self);
        }
        let out_of_memory = last.outcome == Outcome::OutOfMemory;
        if self.trials.len() >= MOST_SEEDED_TRIALS || (out_of_memory && good.is_some()) {
            return self.bisect_or_finish();
        }
        let (mut next, role) = match last.outcome {
            Outcome::Fit { peak, .. } => (self.corrected(last.batch, peak), Role::Corrected),
            // No measurement and nothing fits yet: a step well down, placed by the estimate
            // alone, measures what the correction needs.
            Outcome::OutOfMemory => (self.round(last.batch * 3 / 4), Role::FromEstimate),
        };
        if let Some(bad) = bad {
            next = next.min(self.round(bad.saturating_sub(1)));
        }
        if good.is_some_and(|good| next <= good || (next - good) as f64 <= good as f64 * WORTH_A_TRIAL) {
            return placed(self);
        }
        if next == 0 || self.trials.iter().any(|t| t.batch == next) {
            return self.bisect_or_finish();
        }
        Next::Try(next, role)
    }

    /// The line above the trials: what the estimates predicted, or why there were none.
    pub(super) fn seed_line(&self) -> Option<String> {
        if let Some(why) = &self.unseeded {
            return Some(format!("estimate: none ({why})"));
        }
        let seed = self.seed.as_ref()?;
        let sizes: Vec<String> = seed.estimates.iter().map(|(batch, _)| batch.to_string()).collect();
        let line = self.line.map(|line| {
            format!(
                ": peak ≈ {} + {} × batch",
                bytes(line.intercept.max(0.0) as u64),
                bytes(line.slope.max(0.0) as u64)
            )
        });
        Some(format!(
            "estimate under fake tensors at {} in {:.2} s{}; predicted {}",
            sizes.join(", "),
            seed.seconds,
            line.unwrap_or_default(),
            self.predicted.unwrap_or(0)
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Settings, Trial};
    use super::*;
    use crate::grid::testing::text_cells;

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    fn settings(usable: u64, margin: f64) -> Settings {
        Settings {
            start: 8,
            max: 8192,
            usable,
            margin,
            power_of_two: false,
            multiple_of: 1,
            verifications: 2,
            steps_per_trial: 2,
        }
    }

    /// A search seeded by `estimate(batch)`, run against a step whose real peak is
    /// `peak(batch)` and which runs out of memory when torch would reserve over `capacity`.
    fn run(settings: Settings, estimate: &dyn Fn(u64) -> u64, peak: &dyn Fn(u64) -> u64, capacity: u64) -> Search {
        let world = |b: u64| match peak(b) {
            p if p > capacity => Outcome::OutOfMemory,
            p => Outcome::Fit { peak: p, reserved: p },
        };
        run_in(settings, estimate, &world)
    }

    /// A search seeded by `estimate`, whose trials go as `world` says.
    fn run_in(settings: Settings, estimate: &dyn Fn(u64) -> u64, world: &dyn Fn(u64) -> Outcome) -> Search {
        let mut search = Search::new(settings).unwrap();
        let mut estimates = Vec::new();
        while let Some(batch) = search.next_estimate(&estimates) {
            estimates.push((batch, estimate(batch)));
        }
        assert!(estimates.len() <= MOST_ESTIMATES);
        search.seed(Seed { estimates, seconds: 0.5 });
        for _ in 0..100 {
            match search.next_trial() {
                Next::Done => return search,
                Next::Try(batch, role) => search.record(Trial { batch, outcome: world(batch), seconds: 0.1, role }),
            }
        }
        panic!("the search did not end: {search:?}")
    }

    #[test]
    fn estimates_seed_the_search_with_a_line_each_and_a_failed_one_leaves_it_to_trials() {
        let mut search = Search::new(settings(8 * GIB, 0.0)).unwrap();
        let mut lines = Vec::new();
        let progress = |line: String| -> Result<(), String> {
            lines.push(line);
            Ok(())
        };
        search.seed_by(Instant::now(), |batch| Ok::<_, String>((batch * MIB, 1)), progress);
        let estimates = &search.seed.as_ref().expect("seeded").estimates;
        assert_eq!(lines.len(), estimates.len());
        assert!(lines[0].starts_with("gpuexp: estimate at batch size 8: torch peak 8"), "{lines:?}");
        let mut failed = Search::new(settings(8 * GIB, 0.0)).unwrap();
        failed.seed_by(Instant::now(), |_| Err("no estimate was made: x".to_string()), |_| Ok(()));
        assert_eq!(failed.unseeded.as_deref(), Some("no estimate was made: x; searched by trials"));
        assert!(failed.seed.is_none());
    }

    fn true_max(capacity: u64, peak: &dyn Fn(u64) -> u64) -> u64 {
        (1..=8192).take_while(|b| peak(*b) <= capacity).last().unwrap_or(0)
    }

    fn check(search: &Search, capacity: u64, peak: &dyn Fn(u64) -> u64, most_trials: usize, share: f64) {
        let found = search.batch_size.unwrap();
        let truth = true_max(capacity, peak);
        assert!(found <= truth && found as f64 >= truth as f64 * share, "found {found}, true {truth}: {search:#?}");
        assert!(search.trials.len() <= most_trials, "{} trials: {search:#?}", search.trials.len());
        assert!(search.trials.iter().all(|t| matches!(t.outcome, Outcome::Fit { .. })), "an OOM: {search:#?}");
    }

    #[test]
    fn an_exact_estimate_places_the_answer_in_two_trials() {
        let peak = |b: u64| 2 * GIB + b * 9 * MIB;
        let search = run(settings(24 * GIB, 0.02), &peak, &peak, 24 * GIB);
        check(&search, 24 * GIB, &peak, 2, 0.97);
        assert_eq!(search.trials[0].role, Role::FromEstimate);
        assert_eq!(search.trials[1].role, Role::Corrected);
        assert!(search.verdict.contains("2 real trials placed the answer"), "{}", search.verdict);
    }

    #[test]
    fn an_estimate_that_misses_a_fixed_cost_or_some_slope_is_corrected_by_the_first_trial() {
        let peak = |b: u64| 2 * GIB + b * 9 * MIB;
        // What a conv net's estimate misses: workspaces that grow with the batch (up to 5%).
        let low = |b: u64| ((2 * GIB + b * 9 * MIB) as f64 * 0.95) as u64;
        // What an LM's estimate misses at small batches: a fixed 20 MiB.
        let fixed = |b: u64| 2 * GIB + b * 9 * MIB - 20 * MIB;
        let high = |b: u64| ((2 * GIB + b * 9 * MIB) as f64 * 1.04) as u64;
        for estimate in [&low as &dyn Fn(u64) -> u64, &fixed, &high] {
            let search = run(settings(24 * GIB, 0.02), estimate, &peak, 24 * GIB);
            check(&search, 24 * GIB, &peak, 2, 0.97);
        }
    }

    #[test]
    fn a_trial_whose_cache_reaches_the_cap_is_not_held_against_the_answer() {
        // An H100 conv net under a 24 GiB cap: at 1172 it peaked at 21.3 GiB and reserved all
        // 24 GiB; the allocator gives that cache back when the step needs it.
        let peak = |b: u64| GIB / 5 + b * 18 * MIB;
        let world = |b: u64| match peak(b) {
            p if p > 24 * GIB => Outcome::OutOfMemory,
            p => Outcome::Fit { peak: p, reserved: (p + p / 8).min(24 * GIB) },
        };
        let search = run_in(settings(24 * GIB, 0.02), &peak, &world);
        check(&search, 24 * GIB, &peak, 2, 0.97);
    }

    #[test]
    fn an_out_of_memory_error_after_a_fit_bisects_between_them() {
        // The estimate is right up to a size, then the device runs out early (fragmentation).
        let peak = |b: u64| GIB + b * 10 * MIB;
        let world = |b: u64| match b {
            b if b > 2000 => Outcome::OutOfMemory,
            b => Outcome::Fit { peak: peak(b), reserved: peak(b) },
        };
        let search = run_in(settings(24 * GIB, 0.02), &peak, &world);
        let found = search.batch_size.unwrap();
        assert!((1940..=2000).contains(&found), "{search:#?}");
        assert!(search.trials.iter().any(|t| t.role == Role::Bisect), "{search:#?}");
    }

    #[test]
    fn estimates_a_few_sizes_apart_do_not_tilt_the_line() {
        // Peaks in steps of 64 MiB (the allocator's segments): the slope between 69 and 71 is noise.
        let peak = |b: u64| (GIB + b * 80 * MIB).div_ceil(64 * MIB) * 64 * MIB;
        let estimates = [(8, peak(8)), (32, peak(32)), (71, peak(71)), (69, peak(69))];
        let line = line_through_largest(&estimates).unwrap();
        assert!((line.slope / (80.0 * MIB as f64) - 1.0).abs() < 0.05, "{line:?}");
    }

    #[test]
    fn a_step_that_fits_at_max_stops_there_after_one_trial() {
        let peak = |b: u64| GIB + b * MIB;
        let search = run(settings(80 * GIB, 0.05), &peak, &peak, 80 * GIB);
        assert_eq!((search.batch_size, search.trials.len()), (Some(8192), 1), "{search:#?}");
        assert_eq!(search.trials[0].batch, 8192);
    }

    #[test]
    fn an_estimate_far_too_low_still_ends_at_a_size_that_fits() {
        // Fragmentation under a cap: the device runs out well before the estimates say.
        let peak = |b: u64| GIB + b * 12 * MIB;
        let estimate = |b: u64| GIB + b * 8 * MIB;
        let search = run(settings(24 * GIB, 0.02), &estimate, &peak, 24 * GIB);
        let found = search.batch_size.unwrap();
        let truth = true_max(24 * GIB, &peak);
        assert!(found <= truth && found as f64 >= truth as f64 * 0.95, "found {found}, true {truth}: {search:#?}");
        assert!(search.trials.iter().any(|t| t.outcome == Outcome::OutOfMemory));
    }

    #[test]
    fn no_room_for_one_sample_hands_over_to_the_trials() {
        let estimate = |b: u64| 30 * GIB + b * MIB;
        let peak = |b: u64| GIB + b * 10 * MIB;
        let search = run(settings(24 * GIB, 0.02), &estimate, &peak, 24 * GIB);
        assert!(search.seed.is_none() && search.unseeded.is_some());
        assert!(search.trials.iter().any(|t| t.role == Role::Probe), "{search:#?}");
        assert!(search.grid().to_text().contains("estimate: none (the estimates predict that no batch size fits"));
    }

    #[test]
    fn estimates_settle_within_a_few_sizes_and_the_table_says_what_they_predicted() {
        // Superlinear in the batch: each estimate moves the prediction a little.
        let peak = |b: u64| GIB + b * 8 * MIB + b * b * 256;
        let search = run(settings(24 * GIB, 0.02), &peak, &peak, 24 * GIB);
        let seed = search.seed.as_ref().unwrap();
        assert!(seed.estimates.len() >= 3, "{seed:?}");
        check(&search, 24 * GIB, &peak, 3, 0.97);
        let text = search.grid().to_text();
        assert!(text.contains("estimate under fake tensors at 8, 32, "), "{text}");
        let roles: Vec<String> = text_cells(&text).into_iter().skip(1).map(|row| row[1].clone()).collect();
        assert_eq!(roles, ["estimate", "corrected"]);
        assert!(!text.contains("fit: ") && !text.contains("predicted: "), "{text}");
    }
}
