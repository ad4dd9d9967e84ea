//! Across ranks: which rank a process is, where its finished reports are published, and how
//! every rank's latest report of an experiment is gathered into one table.
//!
//! Publishing and gathering go through torch.distributed's own key-value store (the process
//! group's, and the one the notebook kernel names in `GPUEXP_RANKS_STORE`), never through
//! collectives: a gatherer polls keys with a deadline, so a dead or hung rank is named missing
//! instead of blocking anyone. The store itself is reached through [`RankStore`], which the
//! bindings implement over torch's Python API.
//!
//! Key layout (all under `gpuexp/v1/`), built for thousands of ranks: one record per rank and
//! experiment name, overwritten by the next run of that name, and two small headers.
//!
//! | key | value |
//! |---|---|
//! | `report/<name>/<rank>` | the rank's latest report of that name, with its run ([`Record`]) |
//! | `name/<name>` | the latest publish of that name: run, world size, rank ([`Header`]) |
//! | `latest` | the same for the latest publish of any name |
//! | `run` | the run token of a process group (set once, by whichever rank comes first) |
//! | `agree/<run>/<call>/<rank>` | a rank's answer of `find_batch_size` across ranks |
//! | `agree/<run>/<call>/read/<rank>` | that the rank has read every answer |

mod agree;
mod device;
mod gather;
mod nccl;
mod publishing;
mod store;
mod table;

use std::time::Duration;

use serde::{Deserialize, Serialize};

pub use agree::{agree, Agreement};
pub use device::{rank_device, Because, DeviceClues};
pub use gather::{gather, GatherError};
pub use nccl::NcclShare;
pub use publishing::{Distributed, ProcessStores, RankStores};
pub use store::{
    check_before_opening, check_store_directory, check_tcp_store, kernel_store_dir, remove_kernel_store_dir, Pending,
    StoreAddress, STORE_TIMEOUT, VALIDATE_TIMEOUT,
};
pub use table::{Gathered, RankRow};

use crate::fork::{Guard, PerProcess};
use crate::report::Report;
use crate::scope::ScopeId;

/// The variable that names the store for ranks: `file:///a/dir` or `tcp://host:port`.
pub const STORE_ENV: &str = "GPUEXP_RANKS_STORE";
/// The FileStore's file inside a `file://` directory.
pub const STORE_FILE: &str = "ranks.store";

pub use crate::report::{hostname, RankIdentity};

// ---- what ended an experiment -------------------------------------------------------------

/// Exceptions that ended experiments' `with` blocks, by scope, until their reports are published.
/// A forked child's scope numbers start again: the parent's exceptions are not its own.
static ERRORS: PerProcess<Vec<(ScopeId, String)>> = PerProcess::new(Vec::new);

fn errors() -> Guard<'static, Vec<(ScopeId, String)>> {
    ERRORS.lock()
}

/// Remembers the exception that ended a scope, for its published record: "Type: message", the
/// message's first line only and at most 500 characters of it (a record travels to every gatherer).
pub fn note_error(scope: ScopeId, kind: &str, message: &str) {
    let first_line: String = message.lines().next().unwrap_or("").chars().take(500).collect();
    errors().push((scope, format!("{kind}: {first_line}")));
}

pub fn take_error(scope: ScopeId) -> Option<String> {
    let mut errors = errors();
    let at = errors.iter().position(|(s, _)| *s == scope)?;
    Some(errors.remove(at).1)
}

// ---- records and keys ----------------------------------------------------------------------

pub mod keys {
    pub const LATEST: &str = "gpuexp/v1/latest";
    pub const RUN: &str = "gpuexp/v1/run";
    pub const NAMES: &str = "gpuexp/v1/name/";

    pub fn name(name: &str) -> String {
        format!("{NAMES}{name}")
    }

    pub fn report(name: &str, rank: u32) -> String {
        format!("gpuexp/v1/report/{name}/{rank}")
    }

    /// A rank's answer of a search (`step` is the search's number), or that it read them all (`<number>/read`).
    pub fn agree(run: &str, step: &str, rank: u32) -> String {
        format!("gpuexp/v1/agree/{run}/{step}/{rank}")
    }
}

/// The latest publish of a name (or of any name): what a gatherer waits for.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Header {
    pub name: String,
    /// The run the publishing rank belongs to; None where nothing tells runs apart.
    pub run: Option<String>,
    pub world_size: u32,
    pub rank: u32,
}

/// One rank's latest report of a name.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Record {
    pub run: Option<String>,
    /// The exception that ended the experiment's `with` block, as "Type: message".
    pub error: Option<String>,
    pub report: Report,
}

/// At most this many holders per device travel with a published report.
const PUBLISHED_HOLDERS: usize = 10;

impl Record {
    /// What a rank publishes: its report without the cell log and timeline (they stay in the
    /// rank's own history), and only the largest holders of leaked memory.
    pub fn new(report: &Report, run: Option<String>, error: Option<String>) -> Record {
        let mut report = report.clone();
        report.cells.clear();
        report.monitor.clear();
        report.trace.clear();
        report.host_trace = None;
        for held in &mut report.holders {
            held.holders.truncate(PUBLISHED_HOLDERS);
        }
        Record { run, error, report }
    }
}

/// torch.distributed's store as gpuexp uses it. Every call returns at once (no call waits for
/// a key), except `pause`, which is where a gatherer waits between polls.
pub trait RankStore {
    type Error;
    fn set_many(&mut self, entries: &[(String, String)]) -> Result<(), Self::Error>;
    fn present(&mut self, key: &str) -> Result<bool, Self::Error>;
    /// Whether every one of the keys is present, in one round trip.
    fn present_all(&mut self, keys: &[String]) -> Result<bool, Self::Error>;
    /// The value of a key known to be present.
    fn get(&mut self, key: &str) -> Result<String, Self::Error>;
    /// The values of keys known to be present, in one round trip.
    fn get_many(&mut self, keys: &[String]) -> Result<Vec<String>, Self::Error>;
    /// Sets `key` to `value` unless it has a value, and returns the value it has then.
    fn claim(&mut self, key: &str, value: &str) -> Result<String, Self::Error>;
    /// The experiment names published so far, where the store can list its keys.
    fn names(&mut self) -> Vec<String>;
    fn pause(&mut self, wait: Duration) -> Result<(), Self::Error>;
}

/// Publishes a finished report of a rank: its record and both headers, in one write.
pub fn publish<S: RankStore>(
    store: &mut S,
    report: &Report,
    run: Option<String>,
    error: Option<String>,
) -> Result<(), S::Error> {
    let Some((rank, world_size)) = report.rank.position() else { return Ok(()) };
    let header = Header { name: report.name.clone(), run: run.clone(), world_size, rank };
    let header = serde_json::to_string(&header).expect("headers serialise");
    let record = serde_json::to_string(&Record::new(report, run, error)).expect("reports serialise");
    store.set_many(&[
        (keys::report(&report.name, rank), record),
        (keys::name(&report.name), header.clone()),
        (keys::LATEST.to_string(), header),
    ])
}

/// `0, 2–5, 9`: rank lists stay short with thousands of ranks.
fn ranges(ranks: &[u32]) -> String {
    let mut parts: Vec<String> = Vec::new();
    let mut i = 0;
    while i < ranks.len() {
        let mut j = i;
        while j + 1 < ranks.len() && ranks[j + 1] == ranks[j] + 1 {
            j += 1;
        }
        parts.push(if j > i { format!("{}–{}", ranks[i], ranks[j]) } else { ranks[i].to_string() });
        i = j + 1;
    }
    parts.join(", ")
}

pub(crate) fn plural_ranks(ranks: &[u32]) -> String {
    format!("{} {}", if ranks.len() == 1 { "rank" } else { "ranks" }, ranges(ranks))
}

#[cfg(test)]
pub(crate) mod testing {
    use std::collections::HashMap;
    use std::time::Duration;

    use super::RankStore;

    /// A store in memory; `pauses` counts the waits of a gather, `reads` its round trips.
    #[derive(Default)]
    pub(crate) struct MemoryStore {
        pub(crate) values: HashMap<String, String>,
        pub(crate) pauses: u32,
        pub(crate) reads: u32,
    }

    impl RankStore for MemoryStore {
        type Error = String;
        fn set_many(&mut self, entries: &[(String, String)]) -> Result<(), String> {
            self.values.extend(entries.iter().cloned());
            Ok(())
        }
        fn present(&mut self, key: &str) -> Result<bool, String> {
            self.reads += 1;
            Ok(self.values.contains_key(key))
        }
        fn present_all(&mut self, keys: &[String]) -> Result<bool, String> {
            self.reads += 1;
            Ok(keys.iter().all(|k| self.values.contains_key(k)))
        }
        fn get(&mut self, key: &str) -> Result<String, String> {
            self.reads += 1;
            self.values.get(key).cloned().ok_or_else(|| format!("no key {key}"))
        }
        fn get_many(&mut self, keys: &[String]) -> Result<Vec<String>, String> {
            self.reads += 1;
            keys.iter().map(|k| self.values.get(k).cloned().ok_or_else(|| format!("no key {k}"))).collect()
        }
        fn claim(&mut self, key: &str, value: &str) -> Result<String, String> {
            Ok(self.values.entry(key.to_string()).or_insert_with(|| value.to_string()).clone())
        }
        fn names(&mut self) -> Vec<String> {
            self.values.keys().filter_map(|k| k.strip_prefix(super::keys::NAMES).map(String::from)).collect()
        }
        fn pause(&mut self, wait: Duration) -> Result<(), String> {
            self.pauses += 1;
            std::thread::sleep(wait);
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::testing::MemoryStore;
    use super::*;
    use crate::report::{Details, Span};
    use crate::snapshot::testing::host;

    pub(super) fn rank_report(name: &str, rank: u32, world_size: u32, rss_peak: u64) -> Report {
        let start = host(0.0, 100 << 20, 100 << 20);
        let end = host(2.0, 100 << 20, rss_peak);
        let span = Span { start: &start, before_teardown: &end, end: Some(&end) };
        let mut report = Report::build(name, false, span, |_| Some(rss_peak), Details::default());
        report.rank = RankIdentity {
            rank: Some(rank),
            local_rank: Some(rank),
            world_size: Some(world_size),
            hostname: Some("node-a".into()),
        };
        report
    }

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let pairs: Vec<(String, String)> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        move |name| pairs.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
    }

    #[test]
    fn an_experiments_error_is_kept_as_its_first_line_until_published() {
        let scope = 9_876_543;
        note_error(scope, "RuntimeError", &format!("{}\nthe traceback's second line", "x".repeat(600)));
        let kept = take_error(scope).unwrap();
        assert_eq!(kept, format!("RuntimeError: {}", "x".repeat(500)));
        assert_eq!(take_error(scope), None, "taken once");
    }

    #[test]
    fn a_rank_is_known_by_its_process_group_or_by_rank_and_world_size() {
        let from_group = RankIdentity::detect(Some((3, 8)), env(&[("LOCAL_RANK", "1")]));
        assert_eq!((from_group.position(), from_group.local_rank), (Some((3, 8)), Some(1)));
        assert!(from_group.hostname.is_some());
        assert_eq!(RankIdentity::detect(None, env(&[("RANK", "2"), ("WORLD_SIZE", "4")])).position(), Some((2, 4)));
        for not_a_rank in
            [vec![("RANK", "2")], vec![("RANK", "4"), ("WORLD_SIZE", "4")], vec![("RANK", "x"), ("WORLD_SIZE", "2")]]
        {
            assert_eq!(RankIdentity::detect(None, env(&not_a_rank)), RankIdentity::default());
        }
    }

    #[test]
    fn identity_keys_are_top_level_in_json_and_absent_outside_a_run() {
        let report = rank_report("train", 1, 2, 1 << 30);
        let json: serde_json::Value = serde_json::to_value(&report).unwrap();
        assert_eq!((json["rank"].as_u64(), json["world_size"].as_u64()), (Some(1), Some(2)));
        assert_eq!((json["local_rank"].as_u64(), json["hostname"].as_str()), (Some(1), Some("node-a")));
        let mut alone = report.clone();
        alone.rank = RankIdentity::default();
        let json = serde_json::to_value(&alone).unwrap();
        assert!(json.get("rank").is_none() && json.get("hostname").is_none());
        assert_eq!(serde_json::from_value::<Report>(json).unwrap().rank, RankIdentity::default());
    }

    #[test]
    fn published_records_are_small_and_read_back_as_reports() {
        let mut store = MemoryStore::default();
        let mut report = rank_report("train", 0, 2, 1 << 30);
        report.holders = vec![crate::report::Holders {
            device: "cpu".into(),
            holders: (0..50)
                .map(|i| crate::report::Holder {
                    path: format!("cache[{i}]"),
                    bytes: 1 << 20,
                    device: "cpu".into(),
                    kind: "tensor".into(),
                    shape: "[1]".into(),
                    saved_for_backward: 0,
                })
                .collect(),
            ..Default::default()
        }];
        publish(&mut store, &report, Some("run-1".into()), None).unwrap();
        let record: Record = serde_json::from_str(&store.values[&keys::report("train", 0)]).unwrap();
        assert_eq!(record.report.holders[0].holders.len(), PUBLISHED_HOLDERS);
        assert_eq!(record.report.rank, report.rank);
        assert!(store.values[&keys::report("train", 0)].len() < 8 << 10);
        let header: Header = serde_json::from_str(&store.values[keys::LATEST]).unwrap();
        assert_eq!(header, Header { name: "train".into(), run: Some("run-1".into()), world_size: 2, rank: 0 });
        let mut not_a_rank = report.clone();
        not_a_rank.rank = RankIdentity::default();
        let mut empty = MemoryStore::default();
        publish(&mut empty, &not_a_rank, None, None).unwrap();
        assert!(empty.values.is_empty(), "only ranks publish");
    }

    #[test]
    fn rank_lists_are_ranges() {
        assert_eq!(ranges(&[0, 1, 2, 5, 7, 8]), "0–2, 5, 7–8");
        assert_eq!(plural_ranks(&[4]), "rank 4");
    }
}
