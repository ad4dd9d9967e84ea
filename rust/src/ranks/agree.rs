//! `find_batch_size` on every rank of a process group: each rank searches its own GPU, then
//! all agree through the store on the largest size that fits on every rank.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::Serialize;

use super::gather::Backoff;
use super::{keys, plural_ranks, RankStore};

/// Every rank's answer and the one they agree on.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Agreement {
    /// By rank: the largest size that fit there, None where none did.
    pub answers: Vec<Option<u64>>,
    /// The smallest of them: it fits on every rank (None when one rank found no size at all).
    pub agreed: Option<u64>,
}

impl Agreement {
    /// What the finder's table says about the ranks: each answer, grouped, and the agreement.
    pub fn lines(&self) -> Vec<String> {
        let mut by_answer: BTreeMap<Option<u64>, Vec<u32>> = BTreeMap::new();
        for (rank, answer) in self.answers.iter().enumerate() {
            by_answer.entry(*answer).or_default().push(rank as u32);
        }
        let answers: Vec<String> = by_answer
            .iter()
            .rev()
            .map(|(answer, ranks)| match answer {
                Some(size) => format!("{size} on {}", plural_ranks(ranks)),
                None => format!("none on {}", plural_ranks(ranks)),
            })
            .collect();
        let agreed = match self.agreed {
            Some(size) => format!("{size}, the largest that fits on every rank"),
            None => "none: no size fits on every rank".into(),
        };
        vec![
            format!("across {} ranks: {agreed}", self.answers.len()),
            format!("each rank's answer: {}", answers.join("; ")),
        ]
    }
}

/// How long a rank that has every answer waits for the others to have read them too.
const READ_TIMEOUT: Duration = Duration::from_secs(30);

/// Publishes this rank's answer of the `call`-th search of the run and waits for every other
/// rank's, up to `timeout`. Err(names the ranks that never answered) after that.
///
/// Then it waits (up to 30 s) until every rank has read every answer: the group's store lives
/// in rank 0, and a rank 0 that left at once would take the answers with it before a slower
/// rank read them.
pub fn agree<S: RankStore>(
    store: &mut S,
    run: &str,
    call: u64,
    (rank, world_size): (u32, u32),
    answer: Option<u64>,
    timeout: Duration,
) -> Result<Result<Agreement, String>, S::Error> {
    let encode = |answer: Option<u64>| answer.map(|a| a.to_string()).unwrap_or_else(|| "none".into());
    store.set_many(&[(keys::agree(run, &call.to_string(), rank), encode(answer))])?;
    let mut answers: Vec<Option<Option<u64>>> = vec![None; world_size as usize];
    let mut backoff = Backoff::new(Instant::now() + timeout);
    loop {
        for other in 0..world_size {
            let slot = &mut answers[other as usize];
            let key = keys::agree(run, &call.to_string(), other);
            if slot.is_none() && store.present(&key)? {
                let value = store.get(&key)?;
                *slot = Some(value.trim().parse().ok());
            }
        }
        if answers.iter().all(Option::is_some) {
            break;
        }
        match backoff.next() {
            Some(wait) => store.pause(wait)?,
            None => {
                let silent: Vec<u32> = (0..world_size).filter(|r| answers[*r as usize].is_none()).collect();
                return Ok(Err(format!(
                    "find_batch_size across ranks: {} gave no answer within {:.0} s; every rank of the process \
                     group must call it (the same number of times). Pass a longer ranks_timeout= if they are only slow.",
                    plural_ranks(&silent),
                    timeout.as_secs_f64()
                )));
            }
        }
    }
    let read = format!("{call}/read");
    store.set_many(&[(keys::agree(run, &read, rank), String::new())])?;
    let everyone: Vec<String> = (0..world_size).map(|other| keys::agree(run, &read, other)).collect();
    let mut backoff = Backoff::new(Instant::now() + READ_TIMEOUT.min(timeout));
    // A rank that died since it answered only shortens nobody's wait past the limit.
    while !store.present_all(&everyone)? {
        match backoff.next() {
            Some(wait) => store.pause(wait)?,
            None => break,
        }
    }
    let answers: Vec<Option<u64>> = answers.into_iter().flatten().collect();
    let agreed = answers.iter().copied().collect::<Option<Vec<u64>>>().and_then(|all| all.into_iter().min());
    Ok(Ok(Agreement { answers, agreed }))
}

#[cfg(test)]
mod tests {
    use super::super::testing::MemoryStore;
    use super::*;

    #[test]
    fn every_rank_gets_the_smallest_answer() {
        let mut store = MemoryStore::default();
        let others = [(keys::agree("r", "0", 1), "384".into()), (keys::agree("r", "0", 2), "512".into())];
        store.set_many(&others).unwrap();
        // The other ranks have read the answers already.
        store
            .set_many(&[(keys::agree("r", "0/read", 1), String::new()), (keys::agree("r", "0/read", 2), String::new())])
            .unwrap();
        let agreement = agree(&mut store, "r", 0, (0, 3), Some(512), Duration::from_secs(1)).unwrap().unwrap();
        assert_eq!(store.pauses, 0, "nobody to wait for");
        assert!(store.values.contains_key(&keys::agree("r", "0/read", 0)));
        assert_eq!(agreement, Agreement { answers: vec![Some(512), Some(384), Some(512)], agreed: Some(384) });
        assert_eq!(
            agreement.lines(),
            vec![
                "across 3 ranks: 384, the largest that fits on every rank",
                "each rank's answer: 512 on ranks 0, 2; 384 on rank 1"
            ]
        );
    }

    #[test]
    fn a_rank_where_nothing_fits_means_nothing_fits_everywhere() {
        let mut store = MemoryStore::default();
        store.set_many(&[(keys::agree("r", "4", 1), "none".into())]).unwrap();
        // Rank 1 died after it answered: the wait for it to read ends at the timeout.
        let started = Instant::now();
        let agreement = agree(&mut store, "r", 4, (0, 2), Some(64), Duration::from_millis(100)).unwrap().unwrap();
        assert!(started.elapsed() < Duration::from_millis(400));
        assert_eq!(agreement.agreed, None);
        assert!(agreement.lines()[1].ends_with("none on rank 1"), "{:?}", agreement.lines());
    }

    #[test]
    fn a_rank_that_never_answers_is_named_after_the_timeout() {
        let mut store = MemoryStore::default();
        let started = Instant::now();
        let why = agree(&mut store, "r", 0, (1, 4), Some(8), Duration::from_millis(60)).unwrap().unwrap_err();
        assert!(started.elapsed() < Duration::from_millis(300));
        assert!(why.contains("ranks 0, 2–3 gave no answer"), "{why}");
    }
}
