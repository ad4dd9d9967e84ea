//! A process and its forks. A fork copies all of memory but only the thread that calls it, so
//! whatever gpuexp keeps per process (open stores, the sampler's thread, caches of this process's
//! ids) is, in a forked child, the parent's: threads that don't exist here, sockets that aren't
//! the child's. [`PerProcess`] and [`ProcessLocal`] make such state invisible in a child, which
//! starts fresh. The parent's copy is forgotten there, never dropped: a drop would join a thread
//! the child doesn't have or close what isn't its own, and forgetting touches no copied page.
//!
//! One `pthread_atfork` hook, registered here, sees every fork, whoever makes it (`os.fork`,
//! multiprocessing, a C library):
//! - just before, it waits until no thread holds state kept [`PerProcess::held_across_forks`]
//!   (the sampler's) and no background thread is inside NVML, and keeps them out: a lock that
//!   another thread held at that instant (NVML's own included) would stay held forever in the
//!   child, whose first use of it would hang. The background readers (the sampler, a timeline)
//!   hold [`reading`] around each round of reads for that;
//! - just after, in the parent and in the child, it lets them in again; in the child it forgets
//!   the parent's PID, so that every [`PerProcess`] reads as new there.

use std::cell::RefCell;
use std::ops::{Deref, DerefMut};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Mutex, MutexGuard, Once, RwLock, RwLockReadGuard, RwLockWriteGuard};

use crate::locks::{lock, unpoisoned};

/// This process's PID, cached (0: not read yet in this process).
static PID: AtomicU32 = AtomicU32::new(0);
/// Set in a child forked after the hook was registered.
static FORKED: AtomicBool = AtomicBool::new(false);

/// Registers the fork hook, once per process tree (a child inherits it). `pid` does it too;
/// the module's import does it first, so that [`is_forked_child`] knows of every fork after it.
pub fn install() {
    static INSTALLED: Once = Once::new();
    // SAFETY: the handlers take and release Rust locks of this module and store to atomics;
    // they never unwind (a panic there aborts).
    INSTALLED.call_once(|| unsafe {
        libc::pthread_atfork(Some(before_fork), Some(after_fork_in_parent), Some(after_fork_in_child));
    });
}

/// This process's PID, cached: state kept per process checks it several times a cell, and
/// each `getpid` is a system call. A fork's child forgets it.
pub fn pid() -> u32 {
    let cached = PID.load(Ordering::Relaxed);
    if cached != 0 {
        return cached;
    }
    install();
    let pid = std::process::id();
    PID.store(pid, Ordering::Relaxed);
    pid
}

/// Whether this process was forked from one that had gpuexp loaded: it runs no cells of its
/// own, and its parent's shell is not its own.
pub fn is_forked_child() -> bool {
    FORKED.load(Ordering::Relaxed)
}

// ---- state kept per process ------------------------------------------------------------------

/// A value that belongs to the process that made it: in a forked child it reads as absent,
/// and it is forgotten there, never dropped (a sampler's thread handle, a monitor's).
pub struct ProcessLocal<T> {
    owner: u32,
    value: Option<T>,
}

impl<T> ProcessLocal<T> {
    pub fn new(value: T) -> Self {
        ProcessLocal { owner: pid(), value: Some(value) }
    }

    fn here(&self) -> bool {
        self.owner == pid()
    }

    /// The value, in the process that made it.
    pub fn get(&self) -> Option<&T> {
        self.value.as_ref().filter(|_| self.here())
    }

    pub fn get_mut(&mut self) -> Option<&mut T> {
        if self.here() {
            self.value.as_mut()
        } else {
            None
        }
    }

    /// The value, in the process that made it; None (and the value forgotten) in a child.
    pub fn into_inner(mut self) -> Option<T> {
        if self.here() {
            self.value.take()
        } else {
            None
        }
    }
}

impl<T> Drop for ProcessLocal<T> {
    fn drop(&mut self) {
        if !self.here() {
            std::mem::forget(self.value.take());
        }
    }
}

/// State kept per process behind a lock (poison-tolerant, as [`crate::locks::lock`]): each
/// process, a forked child included, finds it as `fresh()` makes it the first time it locks it.
/// The parent's value is forgotten in the child, never dropped.
pub struct PerProcess<T> {
    slot: Mutex<Option<ProcessLocal<T>>>,
    fresh: fn() -> T,
    held_across_forks: bool,
}

impl<T> PerProcess<T> {
    pub const fn new(fresh: fn() -> T) -> Self {
        PerProcess { slot: Mutex::new(None), fresh, held_across_forks: false }
    }

    /// For state that threads hold for long and that a child needs: a fork waits until no
    /// thread holds it, so that the child never finds it locked for good. A thread that holds
    /// it must not fork, nor wait for another thread that locks such state.
    pub const fn held_across_forks(fresh: fn() -> T) -> Self {
        PerProcess { slot: Mutex::new(None), fresh, held_across_forks: true }
    }

    pub fn lock(&self) -> Guard<'_, T> {
        let fork_waits = self.held_across_forks.then(|| unpoisoned(HELD_STATE.read()));
        let mut slot = lock(&self.slot);
        if slot.as_ref().and_then(ProcessLocal::get).is_none() {
            *slot = Some(ProcessLocal::new((self.fresh)()));
        }
        Guard { slot, _fork_waits: fork_waits }
    }
}

/// This process's value, locked.
pub struct Guard<'a, T> {
    slot: MutexGuard<'a, Option<ProcessLocal<T>>>,
    /// Dropped after `slot` (fields drop in order): a fork waits until both are.
    _fork_waits: Option<RwLockReadGuard<'static, ()>>,
}

const FILLED: &str = "PerProcess::lock fills the slot for this process";

impl<T> Deref for Guard<'_, T> {
    type Target = T;

    fn deref(&self) -> &T {
        self.slot.as_ref().and_then(ProcessLocal::get).expect(FILLED)
    }
}

impl<T> DerefMut for Guard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        self.slot.as_mut().and_then(ProcessLocal::get_mut).expect(FILLED)
    }
}

// ---- the fork hook ---------------------------------------------------------------------------

/// Guards of state kept across forks share it; a fork excludes them.
static HELD_STATE: RwLock<()> = RwLock::new(());
/// Background readers share it (the sampler and a timeline never wait for each other); a fork excludes them.
static NVML: RwLock<()> = RwLock::new(());

type ForkHold = (RwLockWriteGuard<'static, ()>, RwLockWriteGuard<'static, ()>);

thread_local! {
    /// The forking thread's hold, from just before the fork until just after it.
    static HELD: RefCell<Option<ForkHold>> = const { RefCell::new(None) };
}

/// Held by a background thread while it is inside NVML: a fork waits until it is out.
pub fn reading() -> RwLockReadGuard<'static, ()> {
    unpoisoned(NVML.read())
}

/// State first: starting the sampler holds its state until the thread's first round of reads,
/// which waits for the NVML gate.
extern "C" fn before_fork() {
    let state = unpoisoned(HELD_STATE.write());
    let nvml = unpoisoned(NVML.write());
    let _ = HELD.try_with(|held| *held.borrow_mut() = Some((state, nvml)));
}

extern "C" fn after_fork_in_parent() {
    let _ = HELD.try_with(|held| held.borrow_mut().take());
}

/// In the child, the forking thread is the one that exists, and holds the copy of the locks.
extern "C" fn after_fork_in_child() {
    after_fork_in_parent();
    PID.store(0, Ordering::Relaxed);
    FORKED.store(true, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;
    use std::time::Duration;

    /// Runs `child` in a forked child (which must only check and leave) and asserts it passed.
    fn in_a_forked_child(child: impl FnOnce() -> bool) {
        // SAFETY: the child only reads and writes this test's state and leaves with _exit.
        let forked = unsafe { libc::fork() };
        if forked == 0 {
            let passed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(child)).unwrap_or(false);
            unsafe { libc::_exit(if passed { 0 } else { 1 }) };
        }
        let mut status = 0;
        assert_eq!(unsafe { libc::waitpid(forked, &mut status, 0) }, forked);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the forked child's check failed");
    }

    #[test]
    fn a_forked_child_has_its_own_pid() {
        let parent = pid();
        assert_eq!(parent, std::process::id());
        assert!(!is_forked_child());
        in_a_forked_child(|| pid() == std::process::id() && pid() != parent && is_forked_child());
        assert_eq!(pid(), parent);
    }

    static STEPS: PerProcess<Vec<u32>> = PerProcess::new(Vec::new);

    #[test]
    fn a_forked_child_starts_fresh_and_the_parent_keeps_its_own() {
        STEPS.lock().push(1);
        in_a_forked_child(|| {
            let fresh = STEPS.lock().is_empty();
            STEPS.lock().push(2);
            fresh && *STEPS.lock() == [2]
        });
        assert_eq!(*STEPS.lock(), [1]);
    }

    static DROPPED: AtomicBool = AtomicBool::new(false);

    struct Thread;

    impl Drop for Thread {
        fn drop(&mut self) {
            DROPPED.store(true, Ordering::SeqCst);
        }
    }

    static RUNNING: PerProcess<Option<Thread>> = PerProcess::new(|| None);

    #[test]
    fn a_forked_child_never_drops_the_parents_values() {
        *RUNNING.lock() = Some(Thread);
        let parents = ProcessLocal::new(Thread);
        in_a_forked_child(|| {
            let unseen = RUNNING.lock().is_none() && parents.get().is_none();
            drop(parents);
            unseen && !DROPPED.load(Ordering::SeqCst)
        });
        // Here they are this process's own: seen, and dropped.
        assert!(RUNNING.lock().is_some());
        RUNNING.lock().take();
        assert!(DROPPED.swap(false, Ordering::SeqCst));
        assert!(ProcessLocal::new(Thread).into_inner().is_some());
        assert!(DROPPED.load(Ordering::SeqCst));
    }

    static SAMPLER: PerProcess<u32> = PerProcess::held_across_forks(|| 0);

    #[test]
    fn a_fork_waits_for_state_held_across_forks_and_for_nvml_readers() {
        let (held, released) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(false)));
        let (holder_held, holder_released) = (held.clone(), released.clone());
        let holder = std::thread::spawn(move || {
            let mut state = SAMPLER.lock();
            holder_held.store(true, Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(30));
            *state += 1;
            holder_released.store(true, Ordering::SeqCst);
        });
        while !held.load(Ordering::SeqCst) {
            std::thread::yield_now();
        }
        before_fork();
        assert!(released.load(Ordering::SeqCst), "a fork went ahead while the state was held");
        let entered = Arc::new(AtomicBool::new(false));
        let flag = entered.clone();
        let reader = std::thread::spawn(move || {
            let _inside = reading();
            flag.store(true, Ordering::SeqCst);
        });
        std::thread::sleep(Duration::from_millis(30));
        assert!(!entered.load(Ordering::SeqCst), "the reader went into NVML during the fork");
        after_fork_in_parent();
        reader.join().unwrap();
        holder.join().unwrap();
        assert!(entered.load(Ordering::SeqCst));
        assert_eq!(*SAMPLER.lock(), 1);
    }
}
