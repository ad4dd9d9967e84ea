//! When the flight recorder keeps torch's allocation history and when it only reads a level.
//!
//! Torch's history costs every allocation and its free about 0.84 µs even without stacks
//! (bench/recorder_cost.py on an H200: +3.4% of a launch-bound step, +2.2% of resnet50 at bs 32).
//! That is too much to pay on every step of a long loop, yet the first steps after a change are
//! where out-of-memory errors come: a new batch size, a new model, optimizer state made on the
//! first step. So each arming (a cell's start, an experiment's opening) records the history for
//! the first `HISTORY_STEPS` completed steps, block by block; after them the history is given
//! back and each step's end reads one level instead (torch's allocated bytes, one allocator stats
//! call: about 21 µs), which is enough to say what grew since the last step but not which blocks.
//!
//! Only training steps (optimizer, trainer and finder steps) count: a cell's end reads its level
//! and leaves the count as it is, and each arming starts the count afresh, so a training cell
//! gets its own first two steps whatever the cells before it did (a setup cell that ends with
//! the history running leaves it running into the next cell, which then counts from two).

/// Completed steps recorded with torch's history after each arming.
pub const HISTORY_STEPS: u32 = 2;

/// Where the recorder is in one arming.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Phase {
    /// Not armed: gpuexp is not active, or the recorder is off.
    #[default]
    Off,
    /// Torch's history runs for the recorder; `steps_left` completed steps to go.
    History { steps_left: u32 },
    /// The history was given back; each step's end reads a level.
    Levels,
}

/// What the bindings do with torch's history after a change of phase.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HistoryChange {
    Keep,
    /// Join (or start) the recording, without stacks.
    Join,
    /// Give the recorder's share back.
    Leave,
}

impl Phase {
    /// At a cell's start or an experiment's opening, while the recorder is wanted: the next
    /// `HISTORY_STEPS` training steps run with the history, whatever ran before.
    pub fn arm(&mut self) -> HistoryChange {
        let was = std::mem::replace(self, Phase::History { steps_left: HISTORY_STEPS });
        if matches!(was, Phase::History { .. }) {
            HistoryChange::Keep
        } else {
            HistoryChange::Join
        }
    }

    /// When gpuexp is no longer active or the recorder was turned off.
    pub fn disarm(&mut self) -> HistoryChange {
        let was = std::mem::replace(self, Phase::Off);
        if matches!(was, Phase::History { .. }) {
            HistoryChange::Leave
        } else {
            HistoryChange::Keep
        }
    }

    /// Whether the step ending now needs a level read: every step after the history was given
    /// back, the one that gives it back (the next step's OOM starts from it), and a cell's end.
    pub fn wants_level(&self, cell: bool) -> bool {
        match self {
            Phase::Off => false,
            Phase::Levels | Phase::History { steps_left: 0 | 1 } => true,
            Phase::History { .. } => cell,
        }
    }

    /// A completed step (`cell`: a cell's end, which counts toward no history): the history's
    /// last training step gives it back.
    pub fn step_ended(&mut self, cell: bool) -> HistoryChange {
        match self {
            _ if cell => HistoryChange::Keep,
            Phase::History { steps_left } if *steps_left > 1 => {
                *steps_left -= 1;
                HistoryChange::Keep
            }
            Phase::History { .. } => {
                *self = Phase::Levels;
                HistoryChange::Leave
            }
            Phase::Off | Phase::Levels => HistoryChange::Keep,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_arming_records_the_first_steps_then_reads_levels() {
        let mut phase = Phase::Off;
        assert!(!phase.wants_level(false));
        assert_eq!(phase.arm(), HistoryChange::Join);
        assert_eq!(phase.arm(), HistoryChange::Keep, "a second arming in the same steps joins nothing");
        let mut changes = Vec::new();
        for _ in 0..HISTORY_STEPS + 2 {
            let wanted = phase.wants_level(false);
            changes.push((wanted, phase.step_ended(false)));
        }
        let last_with_history = HISTORY_STEPS as usize - 1;
        for (index, (wanted, change)) in changes.iter().enumerate() {
            assert_eq!(*wanted, index >= last_with_history, "step {index}");
            let expected = if index == last_with_history { HistoryChange::Leave } else { HistoryChange::Keep };
            assert_eq!(*change, expected, "step {index}");
        }
        assert_eq!(phase, Phase::Levels);
        assert_eq!(phase.arm(), HistoryChange::Join, "the next cell records its first steps again");
    }

    #[test]
    fn disarming_gives_the_history_back_only_where_it_holds_it() {
        let mut phase = Phase::Off;
        assert_eq!(phase.disarm(), HistoryChange::Keep);
        phase.arm();
        assert_eq!(phase.disarm(), HistoryChange::Leave);
        assert_eq!(phase, Phase::Off);
        phase = Phase::Levels;
        assert_eq!(phase.disarm(), HistoryChange::Keep);
        assert_eq!(phase.step_ended(false), HistoryChange::Keep, "an unarmed step changes nothing");
    }

    /// A cell: armed at its start, `training` optimizer steps, then its end. Returns, for each
    /// training step, whether it ran with the history.
    fn cell(phase: &mut Phase, training: u32, changes: &mut Vec<HistoryChange>) -> Vec<bool> {
        changes.push(phase.arm());
        let recorded = (0..training)
            .map(|_| {
                let with_history = matches!(phase, Phase::History { .. });
                changes.push(phase.step_ended(false));
                with_history
            })
            .collect();
        assert!(phase.wants_level(true), "a cell's end reads its level");
        changes.push(phase.step_ended(true));
        recorded
    }

    #[test]
    fn a_training_cell_after_setup_cells_records_its_own_first_two_steps() {
        let mut phase = Phase::Off;
        let mut changes = Vec::new();
        assert!(cell(&mut phase, 0, &mut changes).is_empty(), "setup: the model");
        assert_eq!(phase, Phase::History { steps_left: HISTORY_STEPS }, "a cell's end uses no step");
        cell(&mut phase, 0, &mut changes); // setup: the optimizer
        assert_eq!(cell(&mut phase, 4, &mut changes), [true, true, false, false], "the first training cell");
        assert_eq!(cell(&mut phase, 3, &mut changes), [true, true, false], "the next training cell");
        assert_eq!(cell(&mut phase, 1, &mut changes), [true], "one step leaves one to go");
        assert_eq!(cell(&mut phase, 2, &mut changes), [true, true], "and the next cell counts from two");
        let joins = changes.iter().filter(|c| **c == HistoryChange::Join).count();
        let leaves = changes.iter().filter(|c| **c == HistoryChange::Leave).count();
        assert_eq!((joins, leaves), (3, 3), "{changes:?}");
    }
}
