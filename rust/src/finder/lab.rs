//! The whole batch-size search in order, over [`Lab`]: the bindings run the user's step on a
//! GPU under torch, and the tests a fake. Which size runs next is [`Search`]'s; when the cache
//! empties, what each trial says as it ends, and the cleanup that runs whatever stopped the
//! search are decided here.

use super::{Next, Outcome, Role, Search, Settings, Trial};
use crate::error::Error;
use crate::snapshot::Snapshot;
use crate::units;

/// What the search acts on.
pub trait Lab {
    type Error: From<Error>;
    /// Estimates the step's peak under fake tensors and seeds the search, or notes why not; an
    /// error only for what must stop the search (Ctrl-C, an exit), which leaves as itself.
    fn seed(&mut self, search: &mut Search) -> Result<(), Self::Error>;
    /// Caps torch's allocations at `limit` bytes.
    fn apply_limit(&mut self, limit: u64) -> Result<(), Self::Error>;
    /// Takes the cap off (none to take off is no error).
    fn restore_limit(&mut self) -> Result<(), Self::Error>;
    /// Gives back what the last size left cached (`teardown::BETWEEN_TRIALS`).
    fn release_between_trials(&mut self) -> Result<(), Self::Error>;
    /// Runs the step `steps` times at `batch` in a peak window of its own. An out-of-memory
    /// error is an outcome, cleaned up after; any other error stops the search.
    fn trial(&mut self, batch: u64, role: Role, steps: u32) -> Result<Trial, Self::Error>;
    /// Shows a trial as it ends: its line, and the table so far.
    fn progress(&mut self, line: &str, search: &Search) -> Result<(), Self::Error>;
    /// Shows the search once it stops.
    fn finished(&mut self, search: &Search) -> Result<(), Self::Error>;
    fn hold_interrupts(&mut self);
    /// Returns whether an interrupt came while held.
    fn release_interrupts(&mut self) -> bool;
    fn interrupted(&self) -> Self::Error;
    /// In a rank of a process group: every rank takes the largest size that fits on all.
    fn agree_across_ranks(&mut self, search: &mut Search) -> Result<(), Self::Error>;
}

impl Settings {
    /// `margin=` as given, or its default: 5% of the batch-dependent memory, 2% under a `limit`,
    /// which is then the budget (at a cap, only the allocator's rounding and fragmentation still
    /// need room).
    pub fn margin_or_default(margin: Option<f64>, limit: Option<u64>) -> crate::error::Result<f64> {
        let margin = margin.unwrap_or(if limit.is_some() { 0.02 } else { 0.05 });
        if !(0.0..1.0).contains(&margin) {
            return Err(Error::InvalidArgument(format!(
                "margin must be a share below 1, e.g. margin=0.05; got {margin}"
            )));
        }
        Ok(margin)
    }

    /// What a step's torch peak may use on a GPU: `limit`, or what torch holds plus what is free.
    pub fn usable(limit: Option<u64>, torch_reserved: u64, free: u64) -> u64 {
        limit.unwrap_or(torch_reserved + free)
    }

    /// [`Settings::usable`] on the GPU of torch index `device` as `now` finds it.
    pub fn usable_on(now: &Snapshot, device: u32, limit: Option<u64>) -> crate::error::Result<u64> {
        let gpu = now.gpus.iter().find(|g| g.torch_index == device).ok_or_else(|| {
            Error::InvalidArgument(format!("cuda:{device} is not a visible GPU (or NVML cannot read it)"))
        })?;
        Ok(Settings::usable(limit, gpu.torch.unwrap_or_default().reserved, gpu.free))
    }
}

/// How a trial's steps ended, as the lab saw them: the outcome, or the error that stops the
/// search. An out-of-memory error is an outcome, handed back so the lab frees what it holds.
pub enum TrialEnd<E> {
    Fit(Outcome),
    OutOfMemory(E),
    Failed(E),
}

impl<E: From<Error>> TrialEnd<E> {
    /// `ran`: whether every step ran, `is_oom` telling an out-of-memory error from any other;
    /// `peaks`: torch's (peak, reserved) on `device` over the trial, None where it has none.
    pub fn of(ran: Result<(), E>, is_oom: impl FnOnce(&E) -> bool, peaks: Option<(u64, u64)>, device: u32) -> Self {
        match (ran, peaks) {
            (Ok(()), Some((peak, reserved))) => TrialEnd::Fit(Outcome::Fit { peak, reserved }),
            (Ok(()), None) => {
                TrialEnd::Failed(Error::InvalidArgument(format!("cuda:{device} is not a visible GPU")).into())
            }
            (Err(error), _) if is_oom(&error) => TrialEnd::OutOfMemory(error),
            (Err(error), _) => TrialEnd::Failed(error),
        }
    }
}

/// Runs the search: estimates first (`estimate`), then the trials under `limit`; the cap comes
/// off and the cache empties whatever stopped them, Ctrl-C included (held meanwhile and raised
/// after); then the ranks agree, and the result is shown.
pub fn find<L: Lab>(search: &mut Search, lab: &mut L, limit: Option<u64>, estimate: bool) -> Result<(), L::Error> {
    if estimate {
        lab.seed(search)?;
    }
    if let Some(limit) = limit {
        lab.apply_limit(limit)?;
    }
    let searched = run_trials(search, lab);
    lab.hold_interrupts();
    let restored = lab.restore_limit();
    let released = lab.release_between_trials();
    let interrupted = lab.release_interrupts();
    searched.and(restored).and(released)?;
    if interrupted {
        return Err(lab.interrupted());
    }
    lab.agree_across_ranks(search)?;
    lab.finished(search)
}

/// The trials the search asks for, each shown as it ends.
fn run_trials<L: Lab>(search: &mut Search, lab: &mut L) -> Result<(), L::Error> {
    let mut previous = None;
    while let Next::Try(batch, role) = search.next_trial() {
        if previous != Some(batch) {
            // Blocks cached at another size would fragment this one; repeats keep the steady state.
            lab.release_between_trials()?;
        }
        previous = Some(batch);
        let trial = lab.trial(batch, role, search.settings.steps_per_trial)?;
        let line = search.trial_line(&trial);
        search.record(trial);
        lab.progress(&line, search)?;
    }
    Ok(())
}

impl Search {
    /// Takes the ranks' agreement: the largest size that fits on every rank, and in the verdict
    /// where that overrules this rank's own answer.
    pub fn take_agreement(&mut self, agreement: crate::ranks::Agreement) {
        if let Some(overruled) = agreement.overrules(self.batch_size) {
            self.verdict.push_str(&overruled);
        }
        self.batch_size = agreement.agreed;
        self.ranks = Some(agreement);
    }

    /// A trial in one line, numbered after those recorded so far.
    pub fn trial_line(&self, trial: &Trial) -> String {
        let outcome = match trial.outcome {
            Outcome::Fit { peak, .. } => format!("peak {}", units::bytes(peak)),
            Outcome::OutOfMemory => "out of memory".into(),
        };
        format!(
            "gpuexp: trial {} ({}) batch size {}: {outcome}, {:.2} s",
            self.trials.len() + 1,
            trial.role.label(),
            trial.batch,
            trial.seconds
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_usable_memory_is_the_limit_or_what_torch_holds_and_what_is_free() {
        use crate::snapshot::testing::{gpu, host, torch};
        use crate::snapshot::GpuReading;
        let now = host(1.0, 0, 0).with_gpu(GpuReading {
            free: 6 * MIB,
            torch: Some(torch(0, 4 * MIB, 0, 0)),
            ..gpu(2, "GPU-2")
        });
        assert_eq!(Settings::usable_on(&now, 2, None), Ok(10 * MIB));
        assert_eq!(Settings::usable_on(&now, 2, Some(3 * MIB)), Ok(3 * MIB));
        let Err(Error::InvalidArgument(message)) = Settings::usable_on(&now, 0, None) else { panic!("cuda:0 found") };
        assert!(message.starts_with("cuda:0 is not a visible GPU"), "{message}");
    }

    #[test]
    fn a_trial_fits_runs_out_of_memory_or_stops_the_search() {
        let oom = |e: &Error| matches!(e, Error::Nvml(m) if m == "oom");
        let end = |ran, peaks| TrialEnd::<Error>::of(ran, oom, peaks, 3);
        assert!(matches!(end(Ok(()), Some((5, 8))), TrialEnd::Fit(Outcome::Fit { peak: 5, reserved: 8 })));
        assert!(matches!(end(Err(Error::Nvml("oom".into())), None), TrialEnd::OutOfMemory(_)));
        assert!(matches!(end(Err(Error::Nvml("other".into())), Some((5, 8))), TrialEnd::Failed(Error::Nvml(_))));
        let TrialEnd::Failed(Error::InvalidArgument(message)) = end(Ok(()), None) else { panic!("no peaks passed") };
        assert_eq!(message, "cuda:3 is not a visible GPU");
    }

    const MIB: u64 = 1 << 20;

    /// A step that peaks at 10 MiB per sample and runs out of memory past `capacity` samples.
    #[derive(Default)]
    struct Fake {
        capacity: u64,
        calls: Vec<String>,
        failing_at: Option<u64>,
        interrupt: bool,
    }

    impl Lab for Fake {
        type Error = String;
        fn seed(&mut self, _: &mut Search) -> Result<(), String> {
            self.calls.push("seed".into());
            Ok(())
        }
        fn apply_limit(&mut self, limit: u64) -> Result<(), String> {
            self.calls.push(format!("limit {limit}"));
            Ok(())
        }
        fn restore_limit(&mut self) -> Result<(), String> {
            self.calls.push("restore".into());
            Ok(())
        }
        fn release_between_trials(&mut self) -> Result<(), String> {
            self.calls.push("release".into());
            Ok(())
        }
        fn trial(&mut self, batch: u64, role: Role, steps: u32) -> Result<Trial, String> {
            self.calls.push(format!("trial {batch}×{steps}"));
            if self.failing_at == Some(batch) {
                return Err("ValueError in the step".into());
            }
            let outcome = if batch > self.capacity {
                Outcome::OutOfMemory
            } else {
                Outcome::Fit { peak: batch * 10 * MIB, reserved: batch * 10 * MIB }
            };
            Ok(Trial { batch, outcome, seconds: 0.5, role })
        }
        fn progress(&mut self, line: &str, _: &Search) -> Result<(), String> {
            self.calls.push(line.into());
            Ok(())
        }
        fn finished(&mut self, search: &Search) -> Result<(), String> {
            self.calls.push(format!("finished {:?}", search.batch_size));
            Ok(())
        }
        fn hold_interrupts(&mut self) {
            self.calls.push("hold".into());
        }
        fn release_interrupts(&mut self) -> bool {
            self.calls.push("release interrupts".into());
            self.interrupt
        }
        fn interrupted(&self) -> String {
            "KeyboardInterrupt".into()
        }
        fn agree_across_ranks(&mut self, _: &mut Search) -> Result<(), String> {
            self.calls.push("agree".into());
            Ok(())
        }
    }

    impl From<Error> for String {
        fn from(error: Error) -> String {
            error.to_string()
        }
    }

    fn search(margin: Option<f64>, limit: Option<u64>) -> Search {
        let margin = Settings::margin_or_default(margin, limit).unwrap();
        let usable = Settings::usable(limit, 0, 4096 * MIB);
        Search::new(Settings { margin, ..crate::finder::tests::settings(usable) }).unwrap()
    }

    #[test]
    fn the_default_margin_is_smaller_under_a_limit_and_a_margin_must_be_a_share_below_one() {
        assert_eq!(Settings::margin_or_default(None, None).unwrap(), 0.05);
        assert_eq!(Settings::margin_or_default(None, Some(1 << 30)).unwrap(), 0.02);
        assert_eq!(Settings::margin_or_default(Some(0.1), Some(1 << 30)).unwrap(), 0.1);
        for bad in [1.0, -0.1, f64::NAN] {
            let error = Settings::margin_or_default(Some(bad), None).unwrap_err().to_string();
            assert!(error.contains("margin must be a share below 1"), "{error}");
        }
    }

    #[test]
    fn a_limit_is_the_usable_memory_else_what_torch_holds_plus_what_is_free() {
        assert_eq!(Settings::usable(Some(100), 30, 50), 100);
        assert_eq!(Settings::usable(None, 30, 50), 80);
    }

    #[test]
    fn the_cache_empties_only_when_the_size_changes_and_every_trial_is_shown() {
        let mut lab = Fake { capacity: 200, ..Fake::default() };
        let mut search = search(None, None);
        find(&mut search, &mut lab, None, false).unwrap();
        let trials: Vec<&String> = lab.calls.iter().filter(|c| c.starts_with("trial")).collect();
        let lines = lab.calls.iter().filter(|c| c.starts_with("gpuexp: trial")).count();
        assert_eq!(lines, trials.len(), "each trial has its line");
        for (i, call) in lab.calls.iter().enumerate().filter(|(_, c)| c.starts_with("trial")) {
            let earlier = lab.calls[..i].iter().rev().find(|c| c.starts_with("trial"));
            let released = lab.calls[..i].last().map(String::as_str) == Some("release");
            assert_eq!(released, earlier != Some(call), "{:?}", &lab.calls[..=i]);
        }
        assert!(lab.calls[0].starts_with("release") && !lab.calls.contains(&"seed".to_string()));
        let tail = &lab.calls[lab.calls.len() - 6..];
        assert_eq!(tail[..5], ["hold", "restore", "release", "release interrupts", "agree"]);
        assert_eq!(tail[5], format!("finished {:?}", search.batch_size));
        assert!(search.batch_size.is_some_and(|b| b <= 200));
    }

    #[test]
    fn a_trial_line_says_what_it_found() {
        let search = search(None, None);
        let fit = Trial {
            batch: 16,
            outcome: Outcome::Fit { peak: 160 * MIB, reserved: 0 },
            seconds: 0.5,
            role: Role::Probe,
        };
        assert_eq!(search.trial_line(&fit), "gpuexp: trial 1 (probe) batch size 16: peak 160.00 MiB, 0.50 s");
        let oom = Trial { outcome: Outcome::OutOfMemory, role: Role::Bisect, ..fit };
        assert_eq!(search.trial_line(&oom), "gpuexp: trial 1 (bisect) batch size 16: out of memory, 0.50 s");
    }

    #[test]
    fn a_step_that_raises_stops_the_search_but_the_cap_comes_off_and_the_cache_empties() {
        let mut lab = Fake { capacity: 200, failing_at: Some(16), ..Fake::default() };
        let mut search = search(None, Some(1 << 30));
        let error = find(&mut search, &mut lab, Some(1 << 30), true).unwrap_err();
        assert_eq!(error, "ValueError in the step");
        assert_eq!(lab.calls[..2], ["seed", format!("limit {}", 1 << 30).as_str()]);
        assert_eq!(lab.calls[lab.calls.len() - 4..], ["hold", "restore", "release", "release interrupts"]);
    }

    #[test]
    fn an_interrupt_held_during_the_cleanup_is_raised_after_it_and_the_ranks_are_not_asked() {
        let mut lab = Fake { capacity: 200, interrupt: true, ..Fake::default() };
        let error = find(&mut search(None, None), &mut lab, None, false).unwrap_err();
        assert_eq!(error, "KeyboardInterrupt");
        assert!(!lab.calls.contains(&"agree".to_string()));
    }
}
