//! Torch's snapshot pickles of the latest traced reports, by report (name and start), for
//! `save_snapshot`: each can be tens of MiB, so older reports give theirs up.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use crate::locks::lock;
use crate::report::Report;

static KEPT: Mutex<VecDeque<(String, Arc<Vec<u8>>)>> = Mutex::new(VecDeque::new());
const KEPT_SNAPSHOTS: usize = 4;

fn report_key(report: &Report) -> String {
    format!("{}\u{0}{}", report.name, report.started_at)
}

/// Keeps `report`'s snapshot; the oldest kept gives its up beyond [`KEPT_SNAPSHOTS`].
pub fn keep(report: &Report, pickle: Vec<u8>) {
    let mut kept = lock(&KEPT);
    kept.push_back((report_key(report), Arc::new(pickle)));
    while kept.len() > KEPT_SNAPSHOTS {
        kept.pop_front();
    }
}

/// `report`'s snapshot, where it is among the latest kept.
pub fn kept(report: &Report) -> Option<Arc<Vec<u8>>> {
    let key = report_key(report);
    lock(&KEPT).iter().find(|(kept, _)| *kept == key).map(|(_, pickle)| pickle.clone())
}
