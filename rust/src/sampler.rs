//! A native thread that samples host RSS where the kernel's peak (VmHWM) cannot be reset.
//! It never touches Python, so it never waits for the GIL and the GIL never waits for it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::Duration;

use crate::snapshot::host;

struct Running {
    /// The process that started the thread: a forked child inherits this struct but not the thread.
    pid: u32,
    stop: Arc<AtomicBool>,
    handle: JoinHandle<()>,
}

static RUNNING: Mutex<Option<Running>> = Mutex::new(None);
static PEAK: AtomicU64 = AtomicU64::new(0);

/// Default interval: fine enough for host allocations, which take far longer than this to fill.
pub const HOST_INTERVAL: Duration = Duration::from_millis(2);

fn running() -> std::sync::MutexGuard<'static, Option<Running>> {
    RUNNING.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Starts the sampler unless it already runs in this process.
pub fn start(interval: Duration) {
    let mut running = running();
    if running.as_ref().is_some_and(|r| r.pid == std::process::id()) {
        return;
    }
    PEAK.fetch_max(host::read_rss(), Ordering::Relaxed);
    let stop = Arc::new(AtomicBool::new(false));
    let flag = stop.clone();
    let spawned = thread::Builder::new().name("gpuexp-sampler".into()).spawn(move || {
        while !flag.load(Ordering::Relaxed) {
            PEAK.fetch_max(host::read_rss(), Ordering::Relaxed);
            thread::park_timeout(interval);
        }
    });
    // Without a thread the peak still holds every snapshot's value; no need to fail the scope.
    if let Ok(handle) = spawned {
        *running = Some(Running { pid: std::process::id(), stop, handle });
    }
}

/// Stops and joins the thread; a no-op where it does not run (or belongs to a parent process).
pub fn stop() {
    let Some(run) = running().take() else { return };
    if run.pid != std::process::id() {
        return;
    }
    run.stop.store(true, Ordering::Relaxed);
    run.handle.thread().unpark();
    let _ = run.handle.join();
}

pub fn is_running() -> bool {
    running().as_ref().is_some_and(|r| r.pid == std::process::id())
}

/// Highest RSS seen since the last reset.
pub fn peak() -> u64 {
    PEAK.load(Ordering::Relaxed)
}

/// Starts a new window at the current RSS.
pub fn reset() {
    PEAK.store(host::read_rss(), Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sees_a_short_spike_and_stops_cleanly() {
        let _guard = host::tests::serial();
        start(Duration::from_millis(1));
        reset();
        let before = peak();
        let spike: Vec<u8> = vec![1; 256 << 20];
        thread::sleep(Duration::from_millis(30));
        drop(spike);
        assert!(peak() >= before + (200 << 20), "peak {} before {}", peak(), before);
        stop();
        assert!(!is_running());
        reset();
        assert!(peak() < before + (200 << 20));
    }
}
