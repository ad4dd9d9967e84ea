//! Gathering every rank's latest report of a name: wait for its header, then poll the ranks'
//! records with a backoff until all are there or the deadline passes, so a dead or hung rank is
//! named missing instead of blocking the gatherer.

use std::time::{Duration, Instant};

use super::{keys, Gathered, Header, RankStore, Record, STORE_ENV};

/// Why a gather found nothing to gather.
#[derive(Debug)]
pub enum GatherError<E> {
    Store(E),
    NothingPublished(String),
}

impl<E> From<E> for GatherError<E> {
    fn from(error: E) -> Self {
        GatherError::Store(error)
    }
}

/// Waits between polls: short at first (ranks that just finished), then up to 50 ms.
pub(super) struct Backoff {
    next: Duration,
    deadline: Instant,
}

impl Backoff {
    pub(super) fn new(deadline: Instant) -> Backoff {
        Backoff { next: Duration::from_millis(2), deadline }
    }

    /// The next wait, or None once the deadline has passed.
    pub(super) fn next(&mut self) -> Option<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return None;
        }
        let wait = self.next.min(left);
        self.next = (self.next * 2).min(Duration::from_millis(50));
        Some(wait)
    }
}

/// Every rank's latest report of `name` (the latest published name when None), from the run
/// that published it last. Ranks that have not published it by `timeout` are named missing.
pub fn gather<S: RankStore>(
    store: &mut S,
    name: Option<&str>,
    timeout: Duration,
    where_: &str,
) -> Result<Gathered, GatherError<S::Error>> {
    let started = Instant::now();
    let mut backoff = Backoff::new(started + timeout);
    let header_key = name.map(keys::name).unwrap_or_else(|| keys::LATEST.to_string());
    let header: Header = loop {
        if store.present(&header_key)? {
            if let Ok(header) = serde_json::from_str(&store.get(&header_key)?) {
                break header;
            }
        }
        match backoff.next() {
            Some(wait) => store.pause(wait)?,
            None => return Err(GatherError::NothingPublished(nothing_published(store, name, timeout, where_))),
        }
    };
    let mut records: Vec<Option<Record>> = vec![None; header.world_size as usize];
    let mut earlier_run = vec![false; records.len()];
    loop {
        let pending: Vec<u32> = (0..header.world_size).filter(|r| records[*r as usize].is_none()).collect();
        if pending.is_empty() {
            break;
        }
        let mut keys: Vec<String> = pending.iter().map(|r| keys::report(&header.name, *r)).collect();
        let mut ranks = pending;
        // Once every rank is done, two round trips gather them all, however many there are.
        if !store.present_all(&keys)? {
            let mut present = Vec::with_capacity(keys.len());
            for (rank, key) in ranks.into_iter().zip(keys) {
                if store.present(&key)? {
                    present.push((rank, key));
                }
            }
            (ranks, keys) = present.into_iter().unzip();
        }
        if !keys.is_empty() {
            for (rank, value) in ranks.into_iter().zip(store.get_many(&keys)?) {
                let Ok(record) = serde_json::from_str::<Record>(&value) else { continue };
                if header.run.is_none() || record.run == header.run {
                    records[rank as usize] = Some(record);
                } else {
                    earlier_run[rank as usize] = true;
                }
            }
        }
        if records.iter().all(Option::is_some) {
            break;
        }
        match backoff.next() {
            Some(wait) => store.pause(wait)?,
            None => break,
        }
    }
    Ok(Gathered::new(header, records, earlier_run, timeout, started.elapsed(), where_))
}

fn nothing_published<S: RankStore>(store: &mut S, name: Option<&str>, timeout: Duration, where_: &str) -> String {
    let what = match name {
        Some(name) => format!("an experiment named {name:?}"),
        None => "any experiment".into(),
    };
    let mut names = store.names();
    names.sort();
    let known = match (name, names.is_empty()) {
        (Some(_), false) => format!(" Published names: {}.", names.join(", ")),
        _ => String::new(),
    };
    format!(
        "no rank published {what} to {where_} within {:.1} s.{known} A rank publishes when its experiment \
         finishes, once torch.distributed is initialised or RANK and WORLD_SIZE are set; ranks started \
         outside this kernel find it through {STORE_ENV} (see docs/ranks.md).",
        timeout.as_secs_f64()
    )
}

#[cfg(test)]
mod tests {
    use super::super::publish;
    use super::super::testing::MemoryStore;
    use super::super::tests::rank_report;
    use super::*;

    #[test]
    fn a_gather_names_the_ranks_that_never_reported_and_returns_by_the_deadline() {
        let mut store = MemoryStore::default();
        for rank in [0, 2] {
            publish(&mut store, &rank_report("train", rank, 4, 1 << 30), Some("b".into()), None).unwrap();
        }
        // Rank 1's report of the name comes from an earlier run: it is not this run's.
        let mut old = rank_report("train", 1, 4, 1 << 30);
        old.duration_s = 99.0;
        store.values.insert(
            keys::report("train", 1),
            serde_json::to_string(&Record::new(&old, Some("a".into()), None)).unwrap(),
        );
        let started = Instant::now();
        let gathered = gather(&mut store, None, Duration::from_millis(150), "memory").ok().unwrap();
        assert!(started.elapsed() < Duration::from_millis(400), "{:?}", started.elapsed());
        assert_eq!(gathered.missing(), vec![1, 3]);
        assert!(
            gathered.flags().iter().any(|f| f.contains("rank 1") && f.contains("earlier run")),
            "{:?}",
            gathered.flags()
        );
        assert!(store.pauses > 1);
    }

    #[test]
    fn a_gather_of_complete_ranks_does_not_wait_and_takes_four_round_trips_however_many_ranks() {
        let mut store = MemoryStore::default();
        for rank in 0..1000 {
            publish(&mut store, &rank_report("eval", rank, 1000, 1 << 30), None, None).unwrap();
        }
        let gathered = gather(&mut store, Some("eval"), Duration::from_secs(5), "memory").ok().unwrap();
        assert!(gathered.missing().is_empty());
        assert_eq!((store.pauses, store.reads), (0, 4), "the header, then every record at once");
    }

    #[test]
    fn nothing_published_says_what_is_there_and_how_ranks_find_the_kernel() {
        let mut store = MemoryStore::default();
        publish(&mut store, &rank_report("train", 0, 1, 1 << 30), None, None).unwrap();
        let Err(GatherError::NothingPublished(why)) =
            gather(&mut store, Some("trian"), Duration::from_millis(20), "file:///d")
        else {
            panic!("a name nobody published")
        };
        assert!(
            why.contains("\"trian\"") && why.contains("Published names: train") && why.contains(STORE_ENV),
            "{why}"
        );
    }
}
