//! The order of a publish and the stores a process keeps, over a fake torch.distributed whose
//! stores are maps shared by their handles.

use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

use super::*;
use crate::ranks::tests::rank_report;

#[derive(Debug, PartialEq)]
enum Failure {
    Said(String),
    Interrupt,
}

impl From<crate::error::Error> for Failure {
    fn from(error: crate::error::Error) -> Self {
        Failure::Said(error.to_string())
    }
}

/// A store in memory; its clones are the same store. `down` makes every call fail.
#[derive(Clone, Default)]
struct FakeStore {
    values: Rc<RefCell<HashMap<String, String>>>,
    down: bool,
}

impl RankStore for FakeStore {
    type Error = Failure;
    fn set_many(&mut self, entries: &[(String, String)]) -> Result<(), Failure> {
        if self.down {
            return Err(Failure::Said("connection refused".into()));
        }
        self.values.borrow_mut().extend(entries.iter().cloned());
        Ok(())
    }
    fn present(&mut self, key: &str) -> Result<bool, Failure> {
        Ok(self.values.borrow().contains_key(key))
    }
    fn present_all(&mut self, keys: &[String]) -> Result<bool, Failure> {
        Ok(keys.iter().all(|k| self.values.borrow().contains_key(k)))
    }
    fn get(&mut self, key: &str) -> Result<String, Failure> {
        self.values.borrow().get(key).cloned().ok_or_else(|| Failure::Said(format!("no key {key}")))
    }
    fn get_many(&mut self, keys: &[String]) -> Result<Vec<String>, Failure> {
        keys.iter().map(|k| self.get(k)).collect()
    }
    fn claim(&mut self, key: &str, value: &str) -> Result<String, Failure> {
        Ok(self.values.borrow_mut().entry(key.to_string()).or_insert_with(|| value.to_string()).clone())
    }
    fn names(&mut self) -> Vec<String> {
        Vec::new()
    }
    fn pause(&mut self, _: Duration) -> Result<(), Failure> {
        Ok(())
    }
}

/// torch.distributed with a group (or none), the kernel's store at `named` (or none), and a
/// count of the stores it opened.
#[derive(Default)]
struct FakeWorld {
    group: Option<(u32, u32)>,
    group_store: FakeStore,
    env: HashMap<String, String>,
    kernel_store: FakeStore,
    /// What opening the named store does: None opens it.
    refuse: Option<Failure>,
    opened: u32,
}

impl FakeWorld {
    fn rank(rank: u32, world_size: u32) -> FakeWorld {
        FakeWorld { group: Some((rank, world_size)), ..FakeWorld::default() }
    }
    fn naming(mut self, address: &str) -> FakeWorld {
        self.env.insert(STORE_ENV.into(), address.into());
        self
    }
}

impl Distributed for FakeWorld {
    type Store = FakeStore;
    type Error = Failure;
    fn group(&self) -> Option<(u32, u32)> {
        self.group
    }
    fn group_store(&mut self) -> Result<FakeStore, Failure> {
        Ok(self.group_store.clone())
    }
    fn available(&self) -> bool {
        true
    }
    fn open(&mut self, _: &StoreAddress) -> Result<FakeStore, Failure> {
        self.opened += 1;
        match self.refuse.take() {
            Some(failure) => {
                // Refused once, refused again.
                if let Failure::Said(why) = &failure {
                    self.refuse = Some(Failure::Said(why.clone()));
                }
                Err(failure)
            }
            None => Ok(self.kernel_store.clone()),
        }
    }
    fn host(&mut self, _: std::net::TcpListener, _: &str, _: u16) -> Result<FakeStore, Failure> {
        self.opened += 1;
        Ok(self.kernel_store.clone())
    }
    fn same_store(&self, a: &FakeStore, b: &FakeStore) -> bool {
        Rc::ptr_eq(&a.values, &b.values)
    }
    fn is_interrupt(&self, error: &Failure) -> bool {
        *error == Failure::Interrupt
    }
    fn said(&self, error: &Failure) -> String {
        match error {
            Failure::Said(why) => why.clone(),
            Failure::Interrupt => "KeyboardInterrupt".into(),
        }
    }
    fn failure(&self, message: String) -> Failure {
        Failure::Said(message)
    }
    fn var(&self, name: &str) -> Option<String> {
        self.env.get(name).cloned()
    }
}

fn published(store: &FakeStore) -> Vec<String> {
    let mut keys: Vec<String> = store.values.borrow().keys().filter(|k| k.contains("/report/")).cloned().collect();
    keys.sort();
    keys
}

#[test]
fn the_kernels_store_is_opened_once_per_process_and_takes_the_report() {
    let stores = PerProcess::new(ProcessStores::new);
    let mut ranks = RankStores { world: FakeWorld::rank(1, 2).naming("file:///tmp/kernel"), stores: &stores };
    ranks.prepare().unwrap();
    let notes = ranks.publish(&rank_report("train", 1, 2, 1 << 30), Some("ValueError: bad".into()));
    assert!(notes.is_empty(), "{notes:?}");
    assert_eq!(ranks.world.opened, 1);
    assert_eq!(published(&ranks.world.kernel_store), ["gpuexp/v1/report/train/1"]);
    assert!(published(&ranks.world.group_store).is_empty(), "one store, not both");
    // The run token went to the group's store, where every rank of the group claims it.
    assert!(ranks.world.group_store.values.borrow().contains_key(keys::RUN));
    assert!(ranks.last_publish().is_some());
}

#[test]
fn a_store_that_could_not_be_reached_is_not_tried_again_and_the_groups_takes_the_report() {
    let stores = PerProcess::new(ProcessStores::new);
    let mut world = FakeWorld::rank(0, 2).naming("tcp://gone:29500");
    world.refuse = Some(Failure::Said("tcp://gone:29500 refused the connection".into()));
    let mut ranks = RankStores { world, stores: &stores };
    assert!(ranks.prepare().is_ok(), "a store's failure waits for the finish");
    let notes = ranks.publish(&rank_report("train", 0, 2, 1 << 30), None);
    assert_eq!(ranks.world.opened, 1, "not tried again");
    assert_eq!(notes.len(), 1, "{notes:?}");
    assert!(
        notes[0].starts_with("publishing for gpuexp.ranks() failed: tcp://gone:29500 refused the connection")
            && notes[0].ends_with("(not tried again in this process)"),
        "{notes:?}"
    );
    assert_eq!(published(&ranks.world.group_store), ["gpuexp/v1/report/train/0"]);
}

#[test]
fn an_interrupt_while_opening_is_returned_and_the_store_tried_again() {
    let stores = PerProcess::new(ProcessStores::new);
    let mut world = FakeWorld::rank(0, 2).naming("file:///tmp/kernel");
    world.refuse = Some(Failure::Interrupt);
    let mut ranks = RankStores { world, stores: &stores };
    assert_eq!(ranks.prepare(), Err(Failure::Interrupt));
    ranks.prepare().unwrap();
    assert_eq!(ranks.world.opened, 2);
    assert!(stores.lock().unreachable.is_none());
}

#[test]
fn a_store_that_fails_costs_a_note_never_the_report() {
    let stores = PerProcess::new(ProcessStores::new);
    let mut world = FakeWorld::rank(0, 2);
    world.group_store.down = true;
    let mut ranks = RankStores { world, stores: &stores };
    let notes = ranks.publish(&rank_report("train", 0, 2, 1 << 30), None);
    assert_eq!(notes, ["publishing for gpuexp.ranks() failed: the process group's store: connection refused"]);
}

#[test]
fn outside_a_rank_nothing_is_published_or_opened() {
    let stores = PerProcess::new(ProcessStores::new);
    let mut ranks = RankStores { world: FakeWorld::default().naming("file:///tmp/kernel"), stores: &stores };
    ranks.prepare().unwrap();
    let mut report = rank_report("train", 0, 1, 1 << 30);
    report.rank = RankIdentity::default();
    assert!(ranks.publish(&report, None).is_empty());
    assert_eq!(ranks.world.opened, 0);
    assert!(ranks.last_publish().is_none());
}

#[test]
fn the_run_token_is_claimed_once_and_every_rank_of_the_group_shares_it() {
    let stores = PerProcess::new(ProcessStores::new);
    let first = FakeWorld::rank(0, 2);
    let group_store = first.group_store.clone();
    let mut rank0 = RankStores { world: first, stores: &stores };
    let token = rank0.run_token().unwrap().unwrap();
    group_store.values.borrow_mut().clear();
    assert_eq!(rank0.run_token().unwrap().as_deref(), Some(token.as_str()), "kept, not claimed again");
    let other_process = PerProcess::new(ProcessStores::new);
    let mut rank1 = RankStores {
        world: FakeWorld { group_store: group_store.clone(), ..FakeWorld::rank(1, 2) },
        stores: &other_process,
    };
    group_store.values.borrow_mut().insert(keys::RUN.into(), token.clone());
    assert_eq!(rank1.run_token().unwrap(), Some(token));
    let mut torchrun = RankStores { world: FakeWorld::default(), stores: &other_process };
    torchrun.world.env.insert("TORCHELASTIC_RUN_ID".into(), "job7".into());
    torchrun.world.env.insert("TORCHELASTIC_RESTART_COUNT".into(), "2".into());
    assert_eq!(torchrun.run_token().unwrap().as_deref(), Some("job7.2"));
}

#[test]
fn gathering_without_a_store_says_where_to_call_it() {
    let stores = PerProcess::new(ProcessStores::new);
    let mut ranks = RankStores { world: FakeWorld::default(), stores: &stores };
    match ranks.gather(None, Duration::from_millis(1)) {
        Err(GatherError::Store(Failure::Said(why))) => assert!(why.starts_with("no store to gather from"), "{why}"),
        other => panic!("{:?}", other.map(|g| g.name)),
    }
}

#[test]
fn a_published_report_is_gathered_from_the_same_store() {
    let stores = PerProcess::new(ProcessStores::new);
    let mut ranks = RankStores { world: FakeWorld::rank(0, 1), stores: &stores };
    assert!(ranks.publish(&rank_report("train", 0, 1, 1 << 30), None).is_empty());
    let gathered = ranks.gather(Some("train"), Duration::from_millis(10)).ok().unwrap();
    assert_eq!((gathered.name.as_str(), gathered.world_size), ("train", 1));
}

#[test]
fn each_search_agrees_under_its_own_keys_and_says_when_a_rank_is_overruled() {
    let stores = PerProcess::new(ProcessStores::new);
    let mut ranks = RankStores { world: FakeWorld::rank(0, 1), stores: &stores };
    let first = ranks.agree(Some(64), 0.01).unwrap().unwrap();
    assert_eq!(first.agreed, Some(64));
    assert_eq!(first.overrules(Some(64)), None);
    ranks.agree(Some(32), 0.01).unwrap().unwrap();
    let keys: Vec<String> =
        ranks.world.group_store.values.borrow().keys().filter(|k| k.contains("/agree/")).cloned().collect();
    assert!(keys.iter().any(|k| k.ends_with("/1/0")) && keys.iter().any(|k| k.ends_with("/2/0")), "{keys:?}");
    let agreed = Agreement { answers: vec![Some(64), Some(32)], agreed: Some(32) };
    assert_eq!(agreed.overrules(Some(64)).unwrap(), "; this rank alone would run 64, but every rank must run one size");
    let mut alone = RankStores { world: FakeWorld::default(), stores: &stores };
    assert_eq!(alone.agree(Some(8), -1.0), Ok(None));
    let refused = ranks.agree(Some(8), -1.0).unwrap_err();
    assert_eq!(refused, Failure::Said("ranks_timeout must be a number of seconds; got -1".into()));
}

#[test]
fn a_process_hosts_one_store() {
    let stores = PerProcess::new(ProcessStores::new);
    let mut ranks = RankStores { world: FakeWorld::default(), stores: &stores };
    let url = ranks.host("127.0.0.1", 0).unwrap();
    assert!(url.starts_with("tcp://127.0.0.1:"), "{url}");
    assert_eq!(ranks.host("127.0.0.1", 0).unwrap(), url);
    assert_eq!(ranks.world.opened, 1, "a forked child finds its own stores: fork::PerProcess's tests");
}
