//! Peaks of nested windows over counters that reset only as a whole.

use std::collections::{BTreeMap, HashMap};

use crate::snapshot::{Gauge, Snapshot};

/// Peaks of nested windows over process-wide counters that can only be reset as a whole
/// (the kernel's VmHWM, torch's one peak per device). Before any reset, the counters' peaks
/// are folded into every open window, so opening an inner window never erases an outer peak.
#[derive(Default, Debug)]
pub struct PeakBook {
    windows: BTreeMap<u64, HashMap<Gauge, u64>>,
}

impl PeakBook {
    /// Folds a snapshot's values and counter peaks into every open window.
    pub fn observe(&mut self, snapshot: &Snapshot) {
        let gauges = snapshot.gauges();
        for peaks in self.windows.values_mut() {
            for (gauge, _, peak) in &gauges {
                // Looked up before inserting: a window already has most gauges, and cloning the
                // key for `entry` on every snapshot would allocate for nothing.
                match peaks.get_mut(gauge) {
                    Some(seen) => *seen = (*seen).max(*peak),
                    None => {
                        peaks.insert(gauge.clone(), *peak);
                    }
                }
            }
        }
    }

    /// Opens a window at `snapshot`, which must be taken just before the caller resets the
    /// counters: what they saw until then belongs to the windows already open.
    pub fn open(&mut self, window: u64, snapshot: &Snapshot) {
        self.observe(snapshot);
        let start = snapshot.gauges().into_iter().map(|(gauge, current, _)| (gauge, current)).collect();
        self.windows.insert(window, start);
    }

    pub fn peak(&self, window: u64, gauge: &Gauge) -> Option<u64> {
        self.windows.get(&window)?.get(gauge).copied()
    }

    pub fn close(&mut self, window: u64) {
        self.windows.remove(&window);
    }

    pub fn is_empty(&self) -> bool {
        self.windows.is_empty()
    }
}
