//! Where a rank publishes and gathers, and the order of a publish. The store the kernel names in
//! `GPUEXP_RANKS_STORE` is opened once per process (one that could not be reached is not tried
//! again there), else the process group's is used: one store, not both, since a group's store
//! lives in rank 0, which may have exited by the time a slower rank finishes. The run token is
//! claimed once in the group's store. A publish turns every failure into a note and falls back to
//! the group's store where the named one can't be reached. torch.distributed comes in through
//! [`Distributed`], which the bindings implement over Python and the tests over a fake.

use crate::fork::PerProcess;
use std::time::{Duration, Instant};

use super::{agree, gather, hostname, keys, publish, Agreement, GatherError, Gathered, RankStore, StoreAddress};
use super::{RankIdentity, STORE_ENV};
use crate::report::Report;

/// torch.distributed as a rank reaches it.
pub trait Distributed {
    /// A store handle: a clone reaches the same store.
    type Store: RankStore<Error = Self::Error> + Clone;
    /// Bad input (an address that does not parse, a port taken) comes from the core's errors.
    type Error: From<crate::error::Error>;
    /// The initialised default process group: (rank, world size).
    fn group(&self) -> Option<(u32, u32)>;
    /// The default process group's store, which every rank of the group reaches.
    fn group_store(&mut self) -> Result<Self::Store, Self::Error>;
    /// Whether torch.distributed is there to open a store with.
    fn available(&self) -> bool;
    /// Opens the store at `address`, once it answers: one that is gone fails here, at once.
    fn open(&mut self, address: &StoreAddress) -> Result<Self::Store, Self::Error>;
    /// Hosts a store served from `listener`, reached by this process at `connect`:`port`.
    fn host(&mut self, listener: std::net::TcpListener, connect: &str, port: u16) -> Result<Self::Store, Self::Error>;
    fn same_store(&self, a: &Self::Store, b: &Self::Store) -> bool;
    /// Ctrl-C (or another error that is no failure of the store): never swallowed into a note.
    fn is_interrupt(&self, error: &Self::Error) -> bool;
    /// An error as a note quotes it.
    fn said(&self, error: &Self::Error) -> String;
    /// A failure of gpuexp's own, in words.
    fn failure(&self, message: String) -> Self::Error;
    /// An environment variable of this process.
    fn var(&self, name: &str) -> Option<String>;
}

/// A store this process opened or hosts, by the address it was opened for. A forked child
/// inherits the handle but not the connection or the server thread: it forgets it.
struct OpenedStore<S> {
    address: String,
    store: S,
}

/// What this process keeps across publishes: the stores it opened, the run token, the searches
/// agreed so far, and what the last publish cost.
pub struct ProcessStores<S> {
    /// The store `GPUEXP_RANKS_STORE` names, once opened.
    named: Option<OpenedStore<S>>,
    /// The store that could not be opened, by address, and why.
    unreachable: Option<(String, String)>,
    /// The TCPStore this process hosts.
    hosted: Option<OpenedStore<S>>,
    /// The run token of the process group, with the group's store it was claimed in.
    run: Option<(S, String)>,
    /// The searches of `find_batch_size` agreed so far in this run (each call has its keys).
    agreements: u64,
    /// What the last publish cost, for the bench: wall seconds and this thread's CPU seconds.
    last_publish: Option<(f64, f64)>,
}

impl<S> ProcessStores<S> {
    pub const fn new() -> ProcessStores<S> {
        ProcessStores { named: None, unreachable: None, hosted: None, run: None, agreements: 0, last_publish: None }
    }
}

impl<S> Default for ProcessStores<S> {
    fn default() -> Self {
        ProcessStores::new()
    }
}

/// This thread's CPU time: with many ranks on few cores, wall time is mostly waiting for a core.
fn thread_cpu_s() -> f64 {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid clock id and a valid pointer to a timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) };
    now.tv_sec as f64 + now.tv_nsec as f64 * 1e-9
}

/// A process's way to the ranks' stores: the world, and what this process keeps (a forked child
/// finds its own, the parent's stores forgotten, never closed: their sockets aren't its). The lock on
/// `stores` is never held while the world is called: torch may release the GIL to connect, and
/// another thread could then wait for the lock with the GIL held.
pub struct RankStores<'a, W: Distributed> {
    pub world: W,
    pub stores: &'a PerProcess<ProcessStores<W::Store>>,
}

type Target<S> = Option<(S, String)>;

impl<W: Distributed> RankStores<'_, W> {
    /// What the last publish cost, for the bench: wall seconds and this thread's CPU seconds.
    pub fn last_publish(&self) -> Option<(f64, f64)> {
        self.stores.lock().last_publish
    }

    pub fn identity(&self) -> RankIdentity {
        RankIdentity::detect(self.world.group(), |name| self.world.var(name))
    }

    fn current(&self, hosted: bool, address: &str) -> Option<W::Store> {
        let stores = self.stores.lock();
        let opened = if hosted { &stores.hosted } else { &stores.named };
        opened.as_ref().filter(|o| o.address == address).map(|o| o.store.clone())
    }

    /// The store `GPUEXP_RANKS_STORE` names, opened once per process; None where it is not set.
    pub fn named(&mut self) -> Result<Target<W::Store>, W::Error> {
        let Some(value) = self.world.var(STORE_ENV) else { return Ok(None) };
        let address = StoreAddress::parse(&value)?;
        let label = address.to_string();
        if let Some(store) = self.current(true, &label).or_else(|| self.current(false, &label)) {
            return Ok(Some((store, label)));
        }
        if !self.world.available() {
            return Err(self.world.failure(format!(
                "{STORE_ENV} names {label}: gathering across ranks needs torch.distributed (import torch first)"
            )));
        }
        let known = self.stores.lock().unreachable.clone().filter(|(a, _)| *a == label);
        if let Some((_, why)) = known {
            return Err(self.world.failure(format!("{why} (not tried again in this process)")));
        }
        let opened = self.world.open(&address);
        match &opened {
            // Ctrl-C during the checks says nothing about the store: it is tried again next time.
            Err(e) if self.world.is_interrupt(e) => {}
            Err(e) => self.stores.lock().unreachable = Some((label.clone(), self.world.said(e))),
            Ok(_) => {}
        }
        let store = opened?;
        // Two threads opening at once keep the first.
        let mut stores = self.stores.lock();
        match stores.named.as_ref().filter(|o| o.address == label) {
            Some(first) => Ok(Some((first.store.clone(), label))),
            None => {
                stores.named = Some(OpenedStore { address: label.clone(), store: store.clone() });
                Ok(Some((store, label)))
            }
        }
    }

    fn group_target(&mut self) -> Result<Target<W::Store>, W::Error> {
        if self.world.group().is_none() {
            return Ok(None);
        }
        Ok(Some((self.world.group_store()?, "the process group's store".to_string())))
    }

    /// Where this process publishes and gathers: the store `GPUEXP_RANKS_STORE` names (the
    /// kernel's, which every rank it launched reaches), or else the process group's.
    pub fn target(&mut self) -> Result<Target<W::Store>, W::Error> {
        match self.named()? {
            Some(named) => Ok(Some(named)),
            None => self.group_target(),
        }
    }

    /// Tells the runs of a process group apart: one token per group, claimed in its store by
    /// whichever rank comes first. Without a group, torchrun's run id where it names one.
    pub fn run_token(&mut self) -> Result<Option<String>, W::Error> {
        if self.world.group().is_none() {
            let run = self.world.var("TORCHELASTIC_RUN_ID").filter(|r| !r.is_empty() && r != "none");
            let restart = self.world.var("TORCHELASTIC_RESTART_COUNT").unwrap_or_default();
            return Ok(run.map(|r| format!("{r}.{restart}")));
        }
        let store = self.world.group_store()?;
        let cached = (self.stores.lock().run.as_ref())
            .and_then(|(claimed_in, token)| self.world.same_store(claimed_in, &store).then(|| token.clone()));
        if let Some(token) = cached {
            return Ok(Some(token));
        }
        let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
        let mine = format!("{nanos:x}-{:x}-{}", crate::fork::pid(), hostname());
        let token = store.clone().claim(keys::RUN, &mine)?;
        self.stores.lock().run = Some((store, token.clone()));
        Ok(Some(token))
    }

    /// When a rank opens a scope: the run token is claimed and the store opened now, while
    /// every rank is up, so that finishing costs one write. A store's failure waits for the
    /// finish to say it in a note; only an interrupt is returned.
    pub fn prepare(&mut self) -> Result<(), W::Error> {
        if self.identity().position().is_none() {
            return Ok(());
        }
        let run = self.run_token().map(drop);
        self.interrupt_only(run)?;
        let named = self.named().map(drop);
        self.interrupt_only(named)
    }

    fn interrupt_only(&self, prepared: Result<(), W::Error>) -> Result<(), W::Error> {
        match prepared {
            Err(e) if self.world.is_interrupt(&e) => Err(e),
            _ => Ok(()),
        }
    }

    /// Publishes a rank's finished report, with the exception that ended it. A store that fails
    /// costs a note, returned for the report, never the report; where the named store can't be
    /// reached, the group's takes the report.
    pub fn publish(&mut self, report: &Report, error: Option<String>) -> Vec<String> {
        let mut notes = Vec::new();
        if report.rank.position().is_none() {
            return notes;
        }
        let (started, cpu_started) = (Instant::now(), thread_cpu_s());
        let run = self.run_token().unwrap_or_else(|e| {
            let said = self.world.said(&e);
            notes.push(format!("the process group's store did not answer ({said}): runs are not told apart"));
            None
        });
        let store = self.target().or_else(|unreachable| {
            notes.push(format!("publishing for gpuexp.ranks() failed: {}", self.world.said(&unreachable)));
            self.group_target()
        });
        let published = match store {
            Ok(Some((mut store, label))) => {
                publish(&mut store, report, run, error).map_err(|e| format!("{label}: {}", self.world.said(&e)))
            }
            Ok(None) => Ok(()),
            Err(e) => Err(self.world.said(&e)),
        };
        if let Err(failure) = published {
            notes.push(format!("publishing for gpuexp.ranks() failed: {failure}"));
        }
        self.stores.lock().last_publish = Some((started.elapsed().as_secs_f64(), thread_cpu_s() - cpu_started));
        notes
    }

    /// Every rank's latest report of `name` (the latest published when None), from the store
    /// [`Self::target`] gives.
    pub fn gather(&mut self, name: Option<&str>, timeout: Duration) -> Result<Gathered, GatherError<W::Error>> {
        let Some((mut store, label)) = self.target()? else {
            return Err(GatherError::Store(self.world.failure(format!(
                "no store to gather from: call gpuexp.ranks() in a rank of an initialised process group, or in the \
                 notebook that launched the ranks, or set {STORE_ENV} to the store the ranks publish to"
            ))));
        };
        gather(&mut store, name, timeout, &label)
    }

    /// In a rank of an initialised process group: waits up to `timeout_s` for every rank's
    /// answer of this search and agrees on the largest size that fits on every rank. None
    /// without a group (whatever `timeout_s` is).
    pub fn agree(&mut self, answer: Option<u64>, timeout_s: f64) -> Result<Option<Agreement>, W::Error> {
        let Some(position) = self.world.group() else { return Ok(None) };
        let timeout = Duration::try_from_secs_f64(timeout_s).map_err(|_| {
            crate::error::Error::InvalidArgument(format!("ranks_timeout must be a number of seconds; got {timeout_s}"))
        })?;
        let run = self.run_token()?.expect("a group has a run");
        let call = {
            let mut stores = self.stores.lock();
            stores.agreements += 1;
            stores.agreements
        };
        let agreed = agree(&mut self.world.group_store()?, &run, call, position, answer, timeout)?;
        agreed.map(Some).map_err(|why| self.world.failure(why))
    }

    /// Hosts a store in this process, listening on `address` only; its address as
    /// `tcp://host:port`. A second call in the same process gives the first's.
    pub fn host(&mut self, address: &str, port: u16) -> Result<String, W::Error> {
        if let Some(opened) = self.stores.lock().hosted.as_ref() {
            return Ok(opened.address.clone());
        }
        if !self.world.available() {
            return Err(self
                .world
                .failure("hosting a store for ranks needs torch.distributed: import torch first".into()));
        }
        let listener = std::net::TcpListener::bind((address, port))
            .map_err(|e| crate::error::Error::InvalidArgument(format!("could not listen on {address}:{port}: {e}")))?;
        let local = listener.local_addr().map_err(|e| self.world.failure(e.to_string()))?;
        // Ranks on this host reach an unspecified address through loopback; others by this host's name.
        let (connect, advertised) = if local.ip().is_unspecified() {
            ("127.0.0.1".to_string(), hostname())
        } else {
            (local.ip().to_string(), local.ip().to_string())
        };
        let store = self.world.host(listener, &connect, local.port())?;
        let url = StoreAddress::Tcp { host: advertised, port: local.port() }.to_string();
        let mut stores = self.stores.lock();
        match stores.hosted.as_ref() {
            // Another thread hosted one meanwhile: its address is the one ranks were told.
            Some(first) => Ok(first.address.clone()),
            None => {
                stores.hosted = Some(OpenedStore { address: url.clone(), store });
                Ok(url)
            }
        }
    }
}

impl Agreement {
    /// What the finder's verdict adds where this rank's own answer is not the one agreed.
    pub fn overrules(&self, answer: Option<u64>) -> Option<String> {
        (self.agreed != answer).then(|| {
            let alone = answer.map(|a| a.to_string()).unwrap_or_else(|| "none".into());
            format!("; this rank alone would run {alone}, but every rank must run one size")
        })
    }
}

#[cfg(test)]
#[path = "publishing_tests.rs"]
mod tests;
