//! Memory that creeps: kept a little on every iteration (outputs kept with their graphs, a loss
//! appended that still requires grad, a cache that grows across cells) until the device is full.
//! Such a loop fails at whatever line asks last, and a smaller batch only delays it, so it is
//! told apart from a step too big by the levels the flight recorder read before the failure.
//!
//! A creep: the allocated bytes at [`CREEP_RISES`] or more consecutive readings (step ends, the
//! loop's repetitions in torch's history, the floors of each quarter-second of the cell's
//! history, or cells' ends) each rose by at least 1 MiB
//! (the recorder series's `RISE_AT_LEAST`), none lower than the one before, the rise is at least half of the
//! budget at the failure (the memory fraction's cap, else the device), and the failure still holds
//! what rose (nothing gave it back since: at the failure, allocated is at least the run's last
//! reading less one reading's rise, as a temporary freed after the last reading may be).

use serde::Serialize;

use super::Holder;
use crate::recorder::Rising;
use crate::units::bytes;

/// Consecutive rises a creep needs.
pub const CREEP_RISES: u32 = 5;

/// Across cells, each rise within this fraction of their mean: the same cell run again keeps
/// about as much each time, while setup cells (a model, its optimizer, the data) rise unevenly.
pub const CELLS_SAME_WITHIN: f64 = 0.25;

/// Whether the rises between consecutive `levels` are each within [`CELLS_SAME_WITHIN`] of
/// their mean.
pub fn same_rises(levels: &[u64]) -> bool {
    let rises: Vec<f64> = levels.windows(2).map(|w| w[1] as f64 - w[0] as f64).collect();
    let mean = rises.iter().sum::<f64>() / rises.len().max(1) as f64;
    !rises.is_empty() && rises.iter().all(|r| (r - mean).abs() <= CELLS_SAME_WITHIN * mean)
}

/// What the iterations of a creep were.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CreptOver {
    /// Completed training steps (optimizer, trainer or finder steps).
    Steps,
    /// Repetitions of the same allocations in torch's history, where no step completed.
    Repetitions,
    /// Quarter-seconds of the cell's history, where no step completed and nothing repeated: no
    /// iteration within the cell is known.
    WithinCell,
    /// Cells that ran to their end: no iteration within them is known.
    Cells,
}

/// How memory crept before the failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Creep {
    pub over: CreptOver,
    /// The rise over the run.
    pub total: u64,
    /// Iterations (steps, repetitions or cells) the run spans.
    pub iterations: u64,
    /// What each iteration kept (`total / iterations`); None within a cell or across cells.
    pub per_iteration: Option<u64>,
}

/// The runs the recorder had before the failure (across cells, only where the cells rose by
/// about the same each: `same_rises`; the repetitions and the cell's floors only where they
/// can be no single pass: see `oom_rescue`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RisingRuns {
    pub steps: Option<Rising>,
    pub repetitions: Option<Rising>,
    pub within_cell: Option<Rising>,
    pub cells: Option<Rising>,
}

impl Creep {
    /// The creep the runs show, in that order of preference, where the budget is `budget` and
    /// the failure held `at_failure`.
    pub fn find(runs: RisingRuns, budget: u64, at_failure: u64) -> Option<Creep> {
        let crept = |run: &Rising| {
            run.rises >= CREEP_RISES
                && run.iterations() > 0
                && run.total() >= budget / 2
                && at_failure >= run.to.allocated - run.total() / u64::from(run.rises.max(1))
        };
        [
            (runs.steps, CreptOver::Steps),
            (runs.repetitions, CreptOver::Repetitions),
            (runs.within_cell, CreptOver::WithinCell),
            (runs.cells, CreptOver::Cells),
        ]
        .into_iter()
        .find_map(|(run, over)| run.filter(crept).map(|run| (run, over)))
        .map(|(run, over)| Creep {
            over,
            total: run.total(),
            iterations: run.iterations(),
            per_iteration: matches!(over, CreptOver::Steps | CreptOver::Repetitions)
                .then(|| run.total() / run.iterations()),
        })
    }

    /// `torch's allocated rose by about 40.00 MiB a step over 120 steps (+4.69 GiB)`
    pub fn describe(&self) -> String {
        let unit = match self.over {
            CreptOver::Steps => "step",
            CreptOver::Repetitions => "iteration",
            CreptOver::Cells | CreptOver::WithinCell => "cell",
        };
        match self.per_iteration {
            Some(each) => format!(
                "memory crept: torch's allocated rose by about {} a{} {unit} over {} {unit}s (+{} in all), each \
                 keeping what the one before kept",
                bytes(each),
                if unit == "iteration" { "n" } else { "" },
                self.iterations,
                bytes(self.total)
            ),
            None if self.over == CreptOver::WithinCell => format!(
                "memory crept within the cell: torch's lowest allocated rose each time it was read over the last {} \
                 quarter-seconds before the failure (+{} in all) and is still held; no iteration of it repeated exactly, so what \
                 each kept is not known",
                self.iterations,
                bytes(self.total)
            ),
            None => format!(
                "memory crept across cells: torch's allocated rose at each of the last {} cells' ends (+{} in all)",
                self.iterations,
                bytes(self.total)
            ),
        }
    }

    /// The fix: keep numbers, not tensors that hold their graphs, or clear the holder (the
    /// largest one the holder search named after the rescue, where it ran).
    pub fn hint(&self, holder: Option<&Holder>) -> String {
        let named = holder.map(|h| {
            format!(
                "; here the largest holder is {}: `del {}` would return at most {} (graphs may share what they saved)",
                held_line(h),
                h.path,
                bytes(h.bytes + h.saved_for_backward)
            )
        });
        format!(
            "{}: something keeps a tensor from each iteration, so a smaller batch only delays the same error. \
             Keep a number or a detached copy, not the tensor: `.item()` for a loss or metric, `.detach()` \
             (or `.detach().cpu()`) before appending an output; run evaluation under `torch.no_grad()` or \
             `torch.inference_mode()`, which keep no graph; or clear the list, dict or cache that holds them \
             (`outs.clear()`, `del outs`){}",
            self.describe(),
            named.unwrap_or_default()
        )
    }
}

/// `outs (a list of 142 tensors that require grad, each keeping its graph): 5.40 GiB`
pub fn held_line(holder: &Holder) -> String {
    let what = [&holder.kind, &holder.shape].iter().filter(|p| !p.is_empty()).map(|p| p.as_str()).collect::<Vec<_>>();
    format!("{} ({}): {}", holder.path, what.join(" "), bytes(holder.bytes + holder.saved_for_backward))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recorder::Reading;

    const MIB: u64 = 1 << 20;
    const GIB: u64 = 1 << 30;

    /// The run at the end of `levels`, read `apart` iterations apart.
    fn run(levels: &[u64], apart: u64) -> Option<Rising> {
        let readings = levels.iter().enumerate().map(|(i, &allocated)| Reading {
            time_us: i as i64,
            allocated,
            count: i as u64 * apart,
        });
        Rising::ending(readings)
    }

    fn steps(levels: &[u64], apart: u64) -> RisingRuns {
        RisingRuns { steps: run(levels, apart), ..RisingRuns::default() }
    }

    /// `n` levels from `start`, each `each` above the one before.
    fn rising(start: u64, each: u64, n: u64) -> Vec<u64> {
        (0..n).map(|i| start + i * each).collect()
    }

    #[test]
    fn a_steady_rise_over_half_the_budget_is_a_creep_with_what_each_step_kept() {
        // Read every 25 steps, each step keeping 8 MiB: 200 MiB between readings.
        let levels = rising(GIB, 200 * MIB, 30);
        let creep = Creep::find(steps(&levels, 25), 10 * GIB, 7 * GIB).expect("a creep");
        assert_eq!((creep.over, creep.iterations, creep.per_iteration), (CreptOver::Steps, 29 * 25, Some(8 * MIB)));
        assert_eq!(creep.total, 29 * 200 * MIB);
        let text = creep.hint(None);
        assert!(text.contains("about 8.00 MiB a step over 725 steps"), "{text}");
        assert!(text.contains(".item()") && text.contains("torch.no_grad()") && text.contains("del outs"), "{text}");
    }

    #[test]
    fn too_few_rises_too_small_a_rise_or_a_dip_is_no_creep() {
        let budget = 10 * GIB;
        let five_rises = rising(0, GIB, 6);
        assert!(Creep::find(steps(&five_rises, 1), budget, 5 * GIB).is_some(), "five rises of half the budget");
        assert!(Creep::find(steps(&five_rises[1..], 1), budget, 5 * GIB).is_none(), "four rises");
        let small = rising(0, 100 * MIB, 40);
        assert!(Creep::find(steps(&small, 1), budget, 4 * GIB).is_none(), "3.9 GiB is under half the budget");
        let mut dipped = rising(0, 500 * MIB, 12);
        dipped[8] = dipped[7] - MIB;
        assert!(Creep::find(steps(&dipped, 1), budget, 6 * GIB).is_none(), "the run restarts after the dip");
        let flat = vec![5 * GIB; 20];
        assert!(Creep::find(steps(&flat, 1), budget, 9 * GIB).is_none(), "a steady loop with a big step");
        let sub_mebibyte = rising(0, MIB - 1, 10_000);
        assert!(Creep::find(steps(&sub_mebibyte, 1), 8 * GIB, 8 * GIB).is_none(), "rises under 1 MiB each");
        assert!(Creep::find(steps(&five_rises, 1), budget, 4 * GIB).is_some(), "less a reading's rise: a temporary");
        assert!(Creep::find(steps(&five_rises, 1), budget, 4 * GIB - 1).is_none(), "given back before the failure");
    }

    #[test]
    fn cells_rising_by_about_the_same_are_one_cell_run_again_and_setup_cells_are_not() {
        assert!(same_rises(&rising(GIB, 300 * MIB, 8)));
        assert!(same_rises(&[0, 100, 220, 310, 420].map(|m| m * MIB)), "within a quarter of the mean");
        assert!(!same_rises(&[0, 10 * GIB, 30 * GIB, 30 * GIB + 100 * MIB, 31 * GIB]), "a model, its optimizer, data");
        assert!(!same_rises(&[GIB]), "no rise at all");
    }

    #[test]
    fn without_steps_the_repetitions_then_the_cells_say_it() {
        let levels = rising(0, GIB, 8);
        let repeated = RisingRuns { repetitions: run(&levels, 1), cells: run(&levels, 1), ..RisingRuns::default() };
        let creep = Creep::find(repeated, 10 * GIB, 8 * GIB).unwrap();
        assert_eq!((creep.over, creep.per_iteration), (CreptOver::Repetitions, Some(GIB)));
        assert!(creep.describe().contains("about 1.00 GiB an iteration over 7 iterations"), "{}", creep.describe());
        let within = RisingRuns { within_cell: run(&levels, 1), cells: run(&levels, 1), ..RisingRuns::default() };
        let creep = Creep::find(within, 10 * GIB, 8 * GIB).unwrap();
        assert_eq!((creep.over, creep.per_iteration, creep.iterations), (CreptOver::WithinCell, None, 7));
        assert!(creep.describe().contains("crept within the cell"), "{}", creep.describe());
        assert!(creep.describe().contains("7 quarter-seconds") && creep.describe().contains("+7.00 GiB"));
        let cells = RisingRuns { cells: run(&levels, 1), ..RisingRuns::default() };
        let creep = Creep::find(cells, 10 * GIB, 8 * GIB).unwrap();
        assert_eq!((creep.over, creep.per_iteration, creep.total), (CreptOver::Cells, None, 7 * GIB));
        assert!(creep.describe().contains("crept across cells"), "{}", creep.describe());
    }
}
