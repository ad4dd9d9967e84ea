//! The batch-size finder's search: a few exact measurements predict the answer, instead of
//! doubling until an out-of-memory error. Peak memory grows nearly linearly with the batch for
//! most models, so small probes give the line, one further probe checks it, and the predicted
//! size is verified before it is trusted; a failed verification falls back to bisection.
//! When the step's peak can be estimated under fake tensors, the estimates give the line and
//! the trials only place the answer (`seeded`).

use serde::Serialize;

use crate::error::{Error, Result};
use crate::grid::Grid;
use crate::units::bytes;

mod lab;
mod seeded;
pub use lab::{find, Lab, TrialEnd};
pub use seeded::Seed;

/// How one trial of the step went.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub enum Outcome {
    /// It ran: torch's exact peaks during the step, in bytes. `reserved` matters too: a cap or
    /// the device's free memory limits what the allocator reserves, fragmentation included.
    Fit {
        peak: u64,
        reserved: u64,
    },
    OutOfMemory,
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Trial {
    pub batch: u64,
    pub outcome: Outcome,
    pub seconds: f64,
    /// Why this size was tried.
    pub role: Role,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Role {
    Probe,
    LinearityCheck,
    Verify,
    Bisect,
    /// The first trial of a seeded search, a little below the size the estimates predict.
    FromEstimate,
    /// A seeded search's trial at the size a measured peak corrects to.
    Corrected,
    /// The bisected edge less the margin, run before it is the answer.
    HeldBack,
}

impl Role {
    /// The word shown in tables and passed to the Python driver.
    pub fn label(self) -> &'static str {
        match self {
            Role::Probe => "probe",
            Role::LinearityCheck => "check",
            Role::Verify => "verify",
            Role::Bisect => "bisect",
            Role::FromEstimate => "estimate",
            Role::Corrected => "corrected",
            Role::HeldBack => "held back",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Line {
    /// Bytes at batch size 0: weights, optimizer state, workspaces.
    pub intercept: f64,
    /// Bytes per sample.
    pub slope: f64,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Settings {
    pub start: u64,
    pub max: u64,
    /// Bytes the step's peak may use: what torch holds plus what is free, or the limit.
    pub usable: u64,
    /// The share of the batch-dependent memory held back, for steps whose memory varies a little.
    pub margin: f64,
    pub power_of_two: bool,
    pub multiple_of: u64,
    /// How many times the predicted size must run before it is trusted.
    pub verifications: u32,
    /// How many times in a row each trial runs the step: the second run shows the steady state
    /// (optimizer state, and the blocks the first run left cached), which the first can't.
    pub steps_per_trial: u32,
}

/// What to do next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    Try(u64, Role),
    Done,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Search {
    pub settings: Settings,
    pub trials: Vec<Trial>,
    pub line: Option<Line>,
    pub linear: Option<bool>,
    pub predicted: Option<u64>,
    /// Whether a failed verification already lowered the prediction once.
    pub stepped_down: bool,
    /// The answer once the search is done: the largest size that ran within the budget.
    pub batch_size: Option<u64>,
    /// Why the search ended where it did, in words.
    pub verdict: String,
    /// Every rank's answer, where the search ran on each rank of a process group.
    pub ranks: Option<crate::ranks::Agreement>,
    /// The estimates the search started from, when the step could run under fake tensors.
    pub seed: Option<Seed>,
    /// Why the search had no estimates to start from.
    pub unseeded: Option<String>,
    /// Below the batch wanted: which option of `gpuexp.fit` raises the answer, and to what.
    pub raised: Option<String>,
}

/// A check passes when the line predicts the further probe within this share.
const LINEAR_TOLERANCE: f64 = 0.03;
/// Bisection stops once the largest size that fits is within this share of the smallest that
/// doesn't: each further trial near the edge may run out of memory, and gains under 1%.
const BISECT_TOLERANCE: f64 = 0.01;

impl Search {
    pub fn new(settings: Settings) -> Result<Search> {
        if settings.start == 0 || settings.max < settings.start {
            return Err(Error::InvalidArgument(format!(
                "start={} and max={}: start must be at least 1 and max at least start, e.g. find_batch_size(step, start=8, max=4096)",
                settings.start, settings.max
            )));
        }
        if settings.multiple_of == 0 {
            return Err(Error::InvalidArgument("multiple_of must be at least 1, e.g. multiple_of=8".into()));
        }
        if settings.steps_per_trial == 0 {
            return Err(Error::InvalidArgument("steps must be at least 1, e.g. steps=2".into()));
        }
        Ok(Search {
            settings,
            trials: Vec::new(),
            line: None,
            linear: None,
            predicted: None,
            stepped_down: false,
            batch_size: None,
            verdict: String::new(),
            ranks: None,
            seed: None,
            unseeded: None,
            raised: None,
        })
    }

    pub fn record(&mut self, trial: Trial) {
        self.trials.push(trial);
    }

    /// What torch reserved beyond its peak at the larger probe: cached blocks and rounding that
    /// the allocator keeps whatever the batch, and that the usable memory must hold too. (What
    /// it caches in proportion to the batch, it gives back when it nears a cap, so a line
    /// through reserved peaks would predict far too low for a conv net.)
    /// A seeded search has no small probe, and its trials near the edge show the allocator
    /// caching up to the cap (an H100 conv net at 24 GiB: 2.9 GiB reserved above its peak, all
    /// given back when needed): it holds back only the margin.
    fn cached_overhead(&self) -> u64 {
        if self.seed.is_some() {
            return 0;
        }
        self.fit_at(self.settings.start * 2).map_or(0, |(peak, reserved)| reserved.saturating_sub(peak))
    }

    /// Where predictions aim: the usable memory less what torch keeps cached, less the margin.
    /// The margin applies to the part that grows with the batch: held back from everything, it
    /// would cost more than the margin in batch size whenever weights and optimizer state take
    /// room too.
    pub fn budget(&self) -> u64 {
        let (room, held_back) = self.room_and_margin();
        (room - held_back) as u64
    }

    /// The most a trial's peak may reach and still fit: a line extrapolated to twice its span
    /// misses by a few MiB either way, so a prediction aimed at the budget may land just over
    /// it. A step that uses less than half of what the margin holds back leaves the other half.
    fn ceiling(&self) -> u64 {
        let (room, held_back) = self.room_and_margin();
        (room - held_back / 2.0) as u64
    }

    fn room_and_margin(&self) -> (f64, f64) {
        let room = self.settings.usable.saturating_sub(self.cached_overhead()) as f64;
        let held_back = match self.line {
            Some(line) if line.intercept > 0.0 && line.intercept < room => {
                (room - line.intercept) * self.settings.margin
            }
            _ => room * self.settings.margin,
        };
        (room, held_back)
    }

    fn fits(&self, trial: &Trial) -> bool {
        matches!(trial.outcome, Outcome::Fit { peak, reserved } if peak <= self.ceiling() && reserved <= self.settings.usable)
    }

    /// The largest size that ran within the budget every time it was tried and lies below every
    /// failure, and the smallest size that failed at least once.
    fn bounds(&self) -> (Option<u64>, Option<u64>) {
        let bad = self.trials.iter().filter(|t| !self.fits(t)).map(|t| t.batch).min();
        let good =
            self.trials.iter().filter(|t| self.fits(t) && bad.is_none_or(|bad| t.batch < bad)).map(|t| t.batch).max();
        (good, bad)
    }

    /// The peaks (allocated, reserved) of the first trial at `batch` that ran.
    fn fit_at(&self, batch: u64) -> Option<(u64, u64)> {
        self.trials.iter().find_map(|t| match t.outcome {
            Outcome::Fit { peak, reserved } if t.batch == batch => Some((peak, reserved)),
            _ => None,
        })
    }

    fn peak_at(&self, batch: u64) -> Option<u64> {
        self.fit_at(batch).map(|(peak, _)| peak)
    }

    fn line_through(&self, (b1, p1): (u64, u64), (b2, p2): (u64, u64)) -> Line {
        let slope = (p2 as f64 - p1 as f64) / (b2 as f64 - b1 as f64);
        Line { intercept: p1 as f64 - slope * b1 as f64, slope }
    }

    /// The largest size `line` puts under the budget, rounded as asked; 0 when none.
    fn predict(&self, line: Line) -> u64 {
        let room = (self.budget() as f64 - line.intercept) / line.slope;
        if room >= 1.0 {
            self.round(room.floor() as u64)
        } else {
            0
        }
    }

    fn tried(&self, batch: u64, role: Role) -> usize {
        self.trials.iter().filter(|t| t.batch == batch && t.role == role).count()
    }

    /// Rounds down to what the user asked sizes to be.
    pub fn round(&self, batch: u64) -> u64 {
        let mut batch = batch.min(self.settings.max);
        if self.settings.power_of_two && batch > 0 {
            batch = 1 << (63 - batch.leading_zeros());
        }
        let step = self.settings.multiple_of;
        if step > 1 {
            batch -= batch % step;
        }
        batch
    }

    fn finish(&mut self, verdict: String) -> Next {
        self.batch_size = self.bounds().0.map(|b| self.round(b)).filter(|b| *b > 0);
        self.verdict = verdict;
        Next::Done
    }

    pub fn next_trial(&mut self) -> Next {
        if self.seed.is_some() {
            return self.next_seeded();
        }
        let start = self.settings.start;
        // 1. Two small probes give a first line.
        for batch in [start, start * 2] {
            if self.tried(batch, Role::Probe) == 0 && batch <= self.settings.max {
                if self.bounds().1.is_some_and(|bad| bad <= batch) {
                    return self.bisect_or_finish();
                }
                return Next::Try(batch, Role::Probe);
            }
        }
        let (Some(p1), Some(p2)) = (self.peak_at(start), self.peak_at(start * 2)) else {
            return self.bisect_or_finish();
        };
        let first = self.line_through((start, p1), (start * 2, p2));
        if first.slope <= 0.0 {
            // Memory does not grow with the batch: the largest allowed size is the answer, if it runs.
            self.line = Some(first);
            self.linear = Some(false);
            return self.verify(self.round(self.settings.max));
        }
        // 2. A further probe near half the first prediction checks the line where it matters;
        // small batches carry fixed costs that a line through them overstates.
        if self.line.is_none() {
            self.line = Some(first);
        }
        let check = self.round((self.predict(first) / 2).max(start * 4)).min(self.settings.max);
        if self.linear.is_none() {
            if check > start * 2 && self.tried(check, Role::LinearityCheck) == 0 {
                if self.bounds().1.is_some_and(|bad| bad <= check) {
                    return self.bisect_or_finish();
                }
                return Next::Try(check, Role::LinearityCheck);
            }
            let Some(at_check) = self.peak_at(check).filter(|_| check > start * 2) else {
                self.linear = Some(false);
                return self.bisect_or_finish();
            };
            let expected = first.intercept + first.slope * check as f64;
            self.linear = Some(((at_check as f64 - expected) / at_check as f64).abs() <= LINEAR_TOLERANCE);
            // 3. The line through the two largest sizes measured predicts the answer.
            self.line = Some(self.line_through((start * 2, p2), (check, at_check)));
        }
        if self.predicted.is_none() {
            let line = self.line.expect("set above");
            self.predicted = Some(if line.slope > 0.0 { self.predict(line) } else { self.round(self.settings.max) });
        }
        let predicted = self.predicted.expect("set above");
        if predicted == 0 {
            return self.bisect_or_finish();
        }
        self.verify(predicted)
    }

    /// 3. The prediction runs `verifications` times before it is trusted.
    fn verify(&mut self, predicted: u64) -> Next {
        let verified: Vec<&Trial> =
            self.trials.iter().filter(|t| t.batch == predicted && t.role == Role::Verify).collect();
        if verified.iter().any(|t| !self.fits(t)) {
            // A prediction that fails is nearly always just over the edge: one small step down
            // costs fewer trials than bisecting from the last size that fit.
            let lower = self.round(predicted - (predicted * 3 / 100).max(1));
            if !self.stepped_down && self.bounds().0.is_none_or(|good| lower > good) {
                self.stepped_down = true;
                self.predicted = Some(lower);
                return self.verify(lower);
            }
            return self.bisect_or_finish();
        }
        if (verified.len() as u32) < self.settings.verifications {
            return Next::Try(predicted, Role::Verify);
        }
        let at_max = predicted == self.round(self.settings.max);
        self.finish(if at_max {
            format!("max={} fits: the search stops at the largest size allowed", self.settings.max)
        } else {
            format!("the prediction {predicted} ran {} times within the budget", verified.len())
        })
    }

    /// 4. Between the largest size that fit and the smallest that did not.
    fn bisect_or_finish(&mut self) -> Next {
        let (good, bad) = self.bounds();
        let Some(bad) = bad else {
            return self.finish("every size tried fit".into());
        };
        let low = good.unwrap_or(0);
        let middle = self.round(low + (bad - low) / 2);
        let close_enough = good.is_some_and(|good| (bad - good) as f64 <= good as f64 * BISECT_TOLERANCE);
        if close_enough || middle <= low || middle >= bad {
            return match good {
                Some(good) => self.finish_bisected(good, bad),
                None => {
                    self.finish(format!("even batch size {} does not fit in the budget", self.settings.start.min(bad)))
                }
            };
        }
        Next::Try(middle, Role::Bisect)
    }

    /// A bisected size ran only at the edge, where fragmentation under a cap decides from one
    /// run to the next (a small conv net ran two steps at 312 under 4 GiB, then failed on a
    /// third), so `margin` of it is held back, as the budget holds it back for a prediction.
    /// The held-back size runs before it is the answer: memory need not grow monotonically
    /// with the batch (under 4 GiB on an H100, a small transformer ran at 678, 689 and 694 but
    /// ran out at 680, where other kernels were picked), so only a size that ran is known to
    /// fit. One that fails is a new edge, and the search goes on below it.
    fn finish_bisected(&mut self, good: u64, bad: u64) -> Next {
        let margin = self.settings.margin;
        let held_back = self.round((good as f64 * (1.0 - margin)).floor() as u64);
        if held_back > 0 && held_back != good && !self.trials.iter().any(|t| t.batch == held_back) {
            return Next::Try(held_back, Role::HeldBack);
        }
        self.finish(format!("bisected: {good} fits, {bad} does not; {:.0}% held back", margin * 100.0));
        if held_back > 0 {
            // Tried, so it fit: a failure there would have been the edge instead of `bad`.
            self.batch_size = Some(held_back);
        }
        Next::Done
    }
}

impl Search {
    /// The table shown while and after searching: every trial, the fit, the verdict.
    pub fn grid(&self) -> Grid {
        let rows = self
            .trials
            .iter()
            .map(|t| {
                let (peak, reserved, result) = match t.outcome {
                    Outcome::Fit { peak, reserved } => {
                        (bytes(peak), bytes(reserved), if self.fits(t) { "fits" } else { "over budget" })
                    }
                    Outcome::OutOfMemory => ("—".to_string(), "—".to_string(), "out of memory"),
                };
                vec![
                    t.batch.to_string(),
                    t.role.label().into(),
                    peak,
                    reserved,
                    format!("{:.2} s", t.seconds),
                    result.into(),
                ]
            })
            .collect();
        let mut lines = vec![format!(
            "budget: {} of torch peak allocated ({} usable, less {} torch keeps cached; {:.0}% of the batch-dependent part held back)",
            bytes(self.budget()),
            bytes(self.settings.usable),
            bytes(self.cached_overhead()),
            self.settings.margin * 100.0
        )];
        lines.extend(self.seed_line());
        lines.push(match self.settings.steps_per_trial {
            1 => "each trial: one step".to_string(),
            steps => format!("each trial: {steps} steps in a row, from an emptied cache at each new size"),
        });
        // A seeded search's line and prediction come from its estimates, on the line above.
        if let Some(line) = self.line.filter(|_| self.seed.is_none()) {
            let linear = match self.linear {
                Some(true) => "linear (checked by a further probe)",
                Some(false) => "not quite linear: refitted through the larger sizes",
                None => "not yet checked",
            };
            lines.push(format!(
                "fit: peak ≈ {} + {} × batch, {linear}",
                bytes(line.intercept.max(0.0) as u64),
                bytes(line.slope.max(0.0) as u64)
            ));
        }
        if let Some(predicted) = self.predicted.filter(|_| self.seed.is_none()) {
            lines.push(format!("predicted: {predicted}"));
        }
        lines.extend(self.ranks.iter().flat_map(crate::ranks::Agreement::lines));
        let title = match self.batch_size {
            Some(batch) => format!("gpuexp · batch size {batch} · {} trials", self.trials.len()),
            None if self.verdict.is_empty() => format!("gpuexp · searching · {} trials", self.trials.len()),
            None => "gpuexp · no batch size fits".to_string(),
        };
        let mut notes = if self.verdict.is_empty() { Vec::new() } else { vec![format!("verdict: {}", self.verdict)] };
        notes.extend(self.raised.iter().map(|raised| format!("hint: {raised}")));
        Grid {
            title,
            lines,
            header: ["batch size", "trial", "torch peak", "reserved", "time", "result"].map(String::from).to_vec(),
            rows,
            notes,
            compact: false,
        }
    }
}

#[cfg(test)]
mod tests;
