//! A bounded series of levels per device, to tell memory that creeps from a step that is too
//! big: the first level read after the history was given back, the latest levels read at step
//! ends and at cells' ends (a fixed ring of each), and the run of readings, ending at the
//! latest, each at least [`RISE_AT_LEAST`] above the one before. The run is kept as it goes (its
//! first reading, its latest and how many rises), so a creep of ten thousand steps costs what
//! one of ten does: a reading is one comparison and a ring push under the recorder's lock, no
//! allocation once the rings are full, and no read of its own (it uses the level the step's end
//! already read, at most every `LEVEL_EVERY_US`).

use std::collections::VecDeque;

use serde::Serialize;

/// Readings of each kind kept per device: the latest, for the diagnosis to show.
pub const RECENT_KEPT: usize = 16;

/// Devices with a series (a process that touches more keeps the first ones).
pub const DEVICES_KEPT: usize = 16;

/// A reading continues a rising run only if it is at least this far above the one before.
pub const RISE_AT_LEAST: u64 = 1 << 20;

/// Torch's allocated bytes at one step's (or cell's) end, and how many such ends came before in
/// this process: the difference of two counts is the iterations between them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Reading {
    pub time_us: i64,
    pub allocated: u64,
    pub count: u64,
}

/// A run of readings each at least [`RISE_AT_LEAST`] above the one before, ending at `to`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Rising {
    pub from: Reading,
    pub to: Reading,
    /// Readings after `from` in the run.
    pub rises: u32,
}

impl Rising {
    pub fn start(reading: Reading) -> Rising {
        Rising { from: reading, to: reading, rises: 0 }
    }

    /// The run after `reading`: longer where it rose enough, else a new one from it.
    pub fn then(self, reading: Reading) -> Rising {
        if reading.allocated >= self.to.allocated.saturating_add(RISE_AT_LEAST) {
            Rising { from: self.from, to: reading, rises: self.rises + 1 }
        } else {
            Rising::start(reading)
        }
    }

    /// The run at the end of `readings`, in order.
    pub fn ending(readings: impl IntoIterator<Item = Reading>) -> Option<Rising> {
        readings.into_iter().fold(None, |run, reading| {
            Some(run.map_or_else(|| Rising::start(reading), |run: Rising| run.then(reading)))
        })
    }

    pub fn total(&self) -> u64 {
        self.to.allocated - self.from.allocated
    }

    /// Iterations the run spans (readings may be several steps apart).
    pub fn iterations(&self) -> u64 {
        self.to.count - self.from.count
    }
}

/// The latest readings of one kind, and the rising run that ends at the latest.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Readings {
    pub recent: VecDeque<Reading>,
    pub rising: Option<Rising>,
}

impl Readings {
    fn push(&mut self, reading: Reading) {
        if self.recent.len() == RECENT_KEPT {
            self.recent.pop_front();
        }
        self.recent.push_back(reading);
        self.rising = Some(self.rising.map_or_else(|| Rising::start(reading), |run| run.then(reading)));
    }

    pub fn latest(&self) -> Option<Reading> {
        self.recent.back().copied()
    }
}

/// One device's series.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DeviceSeries {
    pub torch_index: u32,
    /// The first level read after the history was last given back (the steps between it and
    /// `steps.latest()` are the difference of their counts).
    pub first: Option<Reading>,
    /// Levels read at training steps' ends (optimizer, trainer, finder).
    pub steps: Readings,
    /// Levels read at cells' ends.
    pub cells: Readings,
}

/// Every device's series in this process.
#[derive(Clone, Debug, Default)]
pub struct Series {
    devices: Vec<DeviceSeries>,
}

impl Series {
    fn device_mut(&mut self, torch_index: u32) -> Option<&mut DeviceSeries> {
        let at = match self.devices.iter().position(|d| d.torch_index == torch_index) {
            Some(at) => at,
            None if self.devices.len() < DEVICES_KEPT => {
                let empty = Readings::default();
                self.devices.push(DeviceSeries { torch_index, first: None, steps: empty.clone(), cells: empty });
                self.devices.len() - 1
            }
            None => return None,
        };
        Some(&mut self.devices[at])
    }

    /// A level read at a training step's end; `gave_back`: this step gave the history back.
    pub fn step_level(&mut self, torch_index: u32, reading: Reading, gave_back: bool) {
        if let Some(device) = self.device_mut(torch_index) {
            if gave_back {
                device.first = Some(reading);
            }
            device.steps.push(reading);
        }
    }

    /// A level read at a cell's end.
    pub fn cell_level(&mut self, torch_index: u32, reading: Reading) {
        if let Some(device) = self.device_mut(torch_index) {
            device.cells.push(reading);
        }
    }

    pub fn device(&self, torch_index: u32) -> Option<&DeviceSeries> {
        self.devices.iter().find(|d| d.torch_index == torch_index)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn reading(count: u64, allocated: u64) -> Reading {
        Reading { time_us: count as i64 * 1000, allocated, count }
    }

    #[test]
    fn a_run_grows_only_while_each_reading_is_a_mebibyte_above_the_last() {
        let levels = [10, 20, 30, 30, 40, 50, 60].map(|m| m * MIB);
        let run = Rising::ending(levels.iter().enumerate().map(|(i, &a)| reading(i as u64 * 3, a))).unwrap();
        assert_eq!(
            (run.from.allocated, run.to.allocated, run.rises),
            (30 * MIB, 60 * MIB, 3),
            "restarted at the flat one"
        );
        assert_eq!((run.total(), run.iterations()), (30 * MIB, 9));
        let barely = Rising::start(reading(0, 0)).then(reading(1, MIB - 1));
        assert_eq!(barely.rises, 0, "less than a mebibyte is no rise");
        assert_eq!(Rising::ending([]), None);
    }

    #[test]
    fn the_series_is_bounded_and_keeps_the_run_and_the_first_level_after_the_history() {
        let mut series = Series::default();
        for step in 0..1000u64 {
            series.step_level(0, reading(step, step * MIB), step == 2);
        }
        series.cell_level(0, reading(1, 5 * MIB));
        let device = series.device(0).unwrap();
        assert_eq!(device.steps.recent.len(), RECENT_KEPT);
        assert_eq!(device.first, Some(reading(2, 2 * MIB)));
        assert_eq!(device.steps.latest(), Some(reading(999, 999 * MIB)));
        let run = device.steps.rising.unwrap();
        assert_eq!((run.from.count, run.rises), (0, 999), "the run outlives the ring");
        assert_eq!(device.cells.latest(), Some(reading(1, 5 * MIB)));
        assert!(series.device(1).is_none());
        for index in 1..=DEVICES_KEPT as u32 {
            series.cell_level(index, reading(0, 0));
        }
        assert!(series.device(DEVICES_KEPT as u32).is_none(), "the devices kept are capped");
    }
}
