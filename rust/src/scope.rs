//! The scope registry: open scopes nest by time, each keeps its start snapshot and its peaks,
//! and finished scopes stay in this kernel's history.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::Arc;

use crate::report::Report;
use crate::snapshot::{Gauge, GpuSelection, Snapshot};

pub type ScopeId = u64;

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
                let seen = peaks.entry(gauge.clone()).or_insert(0);
                *seen = (*seen).max(*peak);
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

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Cpu,
    Gpu,
}

#[derive(Clone, Debug)]
pub struct Scope {
    pub id: ScopeId,
    pub name: String,
    pub kind: Kind,
    pub selection: GpuSelection,
    pub start: Snapshot,
    pub keep: BTreeSet<String>,
    /// Set once teardown has begun: a second finish (say from `__del__` during teardown) waits for none.
    pub closing: bool,
}

/// Where a scope stands when someone asks to finish it.
pub enum Finishing {
    Finished(Arc<Report>),
    /// Teardown is under way further up the stack.
    InProgress,
    Ready(Box<Scope>),
    Unknown,
}

#[derive(Default)]
pub struct Registry {
    next_id: ScopeId,
    unnamed: u64,
    open: Vec<Scope>,
    finished: Vec<(ScopeId, Arc<Report>)>,
    pub peaks: PeakBook,
}

impl Registry {
    pub fn name_or_default(&mut self, name: Option<String>) -> String {
        name.unwrap_or_else(|| {
            self.unnamed += 1;
            format!("exp-{}", self.unnamed)
        })
    }

    pub fn open(&mut self, name: String, kind: Kind, selection: GpuSelection, start: Snapshot) -> ScopeId {
        self.next_id += 1;
        let id = self.next_id;
        self.peaks.open(id, &start);
        self.open.push(Scope { id, name, kind, selection, start, keep: BTreeSet::new(), closing: false });
        id
    }

    pub fn scope(&self, id: ScopeId) -> Option<&Scope> {
        self.open.iter().find(|s| s.id == id)
    }

    pub fn scope_mut(&mut self, id: ScopeId) -> Option<&mut Scope> {
        self.open.iter_mut().find(|s| s.id == id)
    }

    /// The open scope of that name, if any (re-running a constructor cell finishes it first).
    pub fn open_named(&self, name: &str) -> Option<ScopeId> {
        self.open.iter().find(|s| s.name == name && !s.closing).map(|s| s.id)
    }

    /// Scopes opened after `id` and still open, innermost first: they finish before it does.
    pub fn inner_of(&self, id: ScopeId) -> Vec<ScopeId> {
        match self.open.iter().position(|s| s.id == id) {
            Some(at) => self.open[at + 1..].iter().rev().filter(|s| !s.closing).map(|s| s.id).collect(),
            None => Vec::new(),
        }
    }

    pub fn open_ids(&self) -> Vec<ScopeId> {
        self.open.iter().map(|s| s.id).collect()
    }

    /// Marks the scope as closing and hands out what its teardown needs.
    pub fn begin_finish(&mut self, id: ScopeId) -> Finishing {
        if let Some(report) = self.report(id) {
            return Finishing::Finished(report);
        }
        match self.scope_mut(id) {
            Some(scope) if scope.closing => Finishing::InProgress,
            Some(scope) => {
                scope.closing = true;
                Finishing::Ready(Box::new(scope.clone()))
            }
            None => Finishing::Unknown,
        }
    }

    /// Records the finished report and closes the scope's peak window.
    pub fn complete(&mut self, id: ScopeId, report: Report) -> Arc<Report> {
        self.open.retain(|s| s.id != id);
        self.peaks.close(id);
        let report = Arc::new(report);
        self.finished.push((id, report.clone()));
        report
    }

    pub fn report(&self, id: ScopeId) -> Option<Arc<Report>> {
        self.finished.iter().find(|(done, _)| *done == id).map(|(_, r)| r.clone())
    }

    pub fn history(&self) -> Vec<Arc<Report>> {
        self.finished.iter().map(|(_, r)| r.clone()).collect()
    }

    /// Whether any scope is open: the host sampler is needed only then.
    pub fn has_open(&self) -> bool {
        !self.open.is_empty()
    }
}
