//! Forking while gpuexp's background threads read NVML or the host. A fork copies only the
//! thread that calls it: a lock that another thread held inside NVML (or sysinfo) at that
//! instant stays held forever in the child, whose first such read would then hang. So the
//! background readers (the sampler, a timeline) hold [`reading`] around each round of reads,
//! and the forking thread takes it before the fork ([`hold`]) and lets go after it, in the
//! parent and in the child ([`release`]).

use std::cell::RefCell;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Once, RwLock, RwLockReadGuard, RwLockWriteGuard};

/// This process's PID, cached: state kept per process (open files, the sampler, the store)
/// checks it several times a cell, and each `getpid` is a system call. A fork's child forgets it.
pub fn pid() -> u32 {
    static FORGET_IN_CHILDREN: Once = Once::new();
    static PID: AtomicU32 = AtomicU32::new(0);
    extern "C" fn forget() {
        PID.store(0, Ordering::Relaxed);
    }
    let cached = PID.load(Ordering::Relaxed);
    if cached != 0 {
        return cached;
    }
    // SAFETY: registers a handler that only stores to an atomic, which is async-signal-safe.
    FORGET_IN_CHILDREN.call_once(|| unsafe {
        libc::pthread_atfork(None, None, Some(forget));
    });
    let pid = std::process::id();
    PID.store(pid, Ordering::Relaxed);
    pid
}

/// Readers share it (the sampler and a timeline never wait for each other); a fork excludes them.
static GATE: RwLock<()> = RwLock::new(());

thread_local! {
    /// The forking thread's hold, from just before the fork until just after it.
    static HELD: RefCell<Option<RwLockWriteGuard<'static, ()>>> = const { RefCell::new(None) };
}

/// Held by a background thread while it is inside NVML: a fork waits until it is out.
pub fn reading() -> RwLockReadGuard<'static, ()> {
    GATE.read().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Just before a fork: waits for the background readers to be out of NVML and keeps them out.
pub fn hold() {
    let guard = GATE.write().unwrap_or_else(|poisoned| poisoned.into_inner());
    HELD.with(|held| *held.borrow_mut() = Some(guard));
}

/// Just after a fork, in the parent and in the child (where the forking thread is the one
/// that exists, and holds the copy of the lock).
pub fn release() {
    HELD.with(|held| held.borrow_mut().take());
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn a_forked_child_has_its_own_pid() {
        let parent = pid();
        assert_eq!(parent, std::process::id());
        // SAFETY: the child only reads its PID and leaves with _exit.
        let child = unsafe { libc::fork() };
        if child == 0 {
            let right = pid() == std::process::id() && pid() != parent;
            unsafe { libc::_exit(if right { 0 } else { 1 }) };
        }
        let mut status = 0;
        assert_eq!(unsafe { libc::waitpid(child, &mut status, 0) }, child);
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the child saw its parent's PID");
        assert_eq!(pid(), parent);
    }

    #[test]
    fn a_reader_waits_while_a_fork_holds_the_gate() {
        hold();
        let entered = Arc::new(AtomicBool::new(false));
        let flag = entered.clone();
        let reader = std::thread::spawn(move || {
            let _inside = reading();
            flag.store(true, Ordering::SeqCst);
        });
        std::thread::sleep(Duration::from_millis(30));
        assert!(!entered.load(Ordering::SeqCst), "the reader went into NVML during the fork");
        release();
        reader.join().unwrap();
        assert!(entered.load(Ordering::SeqCst));
    }
}
