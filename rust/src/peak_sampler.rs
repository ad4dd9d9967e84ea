//! Peaks between snapshots: a native thread samples what has no peak counter of its own (NVML's
//! device and process memory, and host RSS where the kernel's VmHWM cannot be reset), keeps the
//! highest value since the last reset, and `apply` raises a snapshot's peaks to it. It never
//! touches Python, so it never waits for the GIL and the GIL never waits for it. A spike shorter
//! than the interval can fall between two samples; torch's allocator peaks and VmHWM have no such gap.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::fork::{Guard, PerProcess};
use crate::locks::lock;
use crate::snapshot::nvml::{self, NvmlReading, ProcessUse};
use crate::snapshot::{host, own_pids, Snapshot};

/// What the thread samples.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Sources {
    pub host: bool,
    /// UUIDs of the GPUs to sample.
    pub gpus: Vec<String>,
}

impl Sources {
    pub fn is_empty(&self) -> bool {
        !self.host && self.gpus.is_empty()
    }
}

struct GpuPeak {
    uuid: String,
    device: AtomicU64,
    process: AtomicU64,
    children: AtomicU64,
    /// The latest sample, and when it was taken.
    latest: Mutex<Option<(Instant, NvmlReading)>>,
}

/// Highest values seen since the last reset.
struct Peaks {
    host: AtomicU64,
    gpus: Vec<GpuPeak>,
}

struct Running {
    sources: Sources,
    interval: Duration,
    stop: Arc<AtomicBool>,
    handle: JoinHandle<()>,
    peaks: Arc<Peaks>,
}

/// Held across forks: a child never inherits it locked by a thread starting or stopping the
/// sampler. A forked child has none: the parent's thread does not exist there, so its handle
/// is never joined (a join would wait forever) nor detached; the next scope starts its own.
static RUNNING: PerProcess<Option<Running>> = PerProcess::held_across_forks(|| None);
/// Microseconds between samples.
static INTERVAL_US: AtomicU64 = AtomicU64::new(1000);

pub const MIN_INTERVAL: Duration = Duration::from_micros(100);
pub const MAX_INTERVAL: Duration = Duration::from_secs(60);

fn running() -> Guard<'static, Option<Running>> {
    RUNNING.lock()
}

pub fn interval() -> Duration {
    Duration::from_micros(INTERVAL_US.load(Ordering::Relaxed))
}

/// Sets the interval; a running sampler restarts with it.
pub fn set_interval(interval: Duration) -> Result<()> {
    if !(MIN_INTERVAL..=MAX_INTERVAL).contains(&interval) {
        return Err(Error::InvalidArgument(format!(
            "sample_interval_ms must be between {} and {} milliseconds, e.g. gpuexp.config(sample_interval_ms=1); got {}",
            MIN_INTERVAL.as_secs_f64() * 1e3,
            MAX_INTERVAL.as_secs_f64() * 1e3,
            interval.as_secs_f64() * 1e3
        )));
    }
    INTERVAL_US.store(interval.as_micros() as u64, Ordering::Relaxed);
    let sources = running().as_ref().map(|r| r.sources.clone());
    if let Some(sources) = sources {
        ensure(sources);
    }
    Ok(())
}

/// Whether the sampler already is as `sources` need it (running over exactly them at the
/// current interval, or not running for none), so that `ensure` would do nothing: a caller
/// can then skip releasing the GIL for it.
pub fn is_as_needed(sources: &Sources) -> bool {
    unchanged(running().as_ref(), sources)
}

fn unchanged(run: Option<&Running>, sources: &Sources) -> bool {
    match run {
        Some(run) => run.sources == *sources && run.interval == interval(),
        None => sources.is_empty(),
    }
}

/// Runs the sampler over exactly these sources: starts it, restarts it when the sources or
/// the interval changed, stops it when there is nothing to sample. Returns whether a thread
/// was started; it has then opened its devices and taken a first sample. The lock is held
/// throughout, so that two callers never both start a thread; joining under it is safe
/// because the thread never takes it.
pub fn ensure(sources: Sources) -> bool {
    let mut running = running();
    if unchanged(running.as_ref(), &sources) {
        return false;
    }
    stop_locked(&mut running);
    if sources.is_empty() {
        return false;
    }
    let interval = interval();
    let peaks = Arc::new(Peaks {
        host: AtomicU64::new(host::read_rss()),
        gpus: sources
            .gpus
            .iter()
            .map(|uuid| GpuPeak {
                uuid: uuid.clone(),
                device: AtomicU64::new(0),
                process: AtomicU64::new(0),
                children: AtomicU64::new(0),
                latest: Mutex::new(None),
            })
            .collect(),
    });
    let stop = Arc::new(AtomicBool::new(false));
    let thread_peaks = peaks.clone();
    let thread_stop = stop.clone();
    let thread_sources = sources.clone();
    let (ready, set_up) = std::sync::mpsc::channel();
    let spawned = thread::Builder::new()
        .name("gpuexp-sampler".into())
        .spawn(move || sample(&thread_sources, &thread_peaks, &thread_stop, interval, ready));
    // Without a thread, peaks fall back to what the snapshots see: worse, but no reason to fail a scope.
    let Ok(handle) = spawned else { return false };
    let _ = set_up.recv();
    *running = Some(Running { sources, interval, stop, handle, peaks });
    true
}

fn sample(sources: &Sources, peaks: &Peaks, stop: &AtomicBool, interval: Duration, ready: std::sync::mpsc::Sender<()>) {
    let devices: Vec<_> = sources.gpus.iter().map(|uuid| nvml::open(uuid).ok()).collect();
    let pids = own_pids();
    let mut ready = Some(ready);
    while !stop.load(Ordering::Relaxed) {
        let fork_waits = crate::fork::reading();
        if sources.host {
            peaks.host.fetch_max(host::read_rss(), Ordering::Relaxed);
        }
        for (slot, device) in peaks.gpus.iter().zip(&devices) {
            let Some(device) = device else { continue };
            if let Ok(reading) = nvml::read(device, &pids) {
                slot.device.fetch_max(reading.used, Ordering::Relaxed);
                if let ProcessUse::Listed(bytes) = reading.process {
                    slot.process.fetch_max(bytes, Ordering::Relaxed);
                }
                slot.children.fetch_max(reading.children, Ordering::Relaxed);
                *lock(&slot.latest) = Some((Instant::now(), reading));
            }
        }
        drop(fork_waits);
        if let Some(ready) = ready.take() {
            let _ = ready.send(());
        }
        thread::park_timeout(interval);
    }
}

/// Stops and joins the thread; a no-op where none runs.
/// Callers from Python release the GIL first, though the thread never needs it.
pub fn stop() {
    stop_locked(&mut running());
}

fn stop_locked(running: &mut Option<Running>) {
    let Some(run) = running.take() else { return };
    run.stop.store(true, Ordering::Relaxed);
    run.handle.thread().unpark();
    let _ = run.handle.join();
}

/// UUIDs of the GPUs being sampled.
pub fn sampled_gpus() -> Vec<String> {
    running().as_ref().map(|r| r.sources.gpus.clone()).unwrap_or_default()
}

pub fn is_running() -> bool {
    running().as_ref().is_some()
}

/// The latest sample of a GPU, if the sampler took one within the last two intervals:
/// the per-cell log reads it instead of asking the driver again.
pub fn latest(uuid: &str) -> Option<NvmlReading> {
    let running = running();
    let run = running.as_ref()?;
    let slot = run.peaks.gpus.iter().find(|s| s.uuid == uuid)?;
    let latest = *lock(&slot.latest);
    latest.filter(|(at, _)| at.elapsed() <= run.interval * 2).map(|(_, reading)| reading)
}

/// Raises a snapshot's peaks to what the sampler saw since the last reset.
pub fn apply(snapshot: &mut Snapshot) {
    let running = running();
    let Some(run) = running.as_ref() else { return };
    if run.sources.host {
        let host = &mut snapshot.host;
        host.peak_rss = host.peak_rss.max(run.peaks.host.load(Ordering::Relaxed));
    }
    for gpu in &mut snapshot.gpus {
        let Some(slot) = run.peaks.gpus.iter().find(|s| s.uuid == gpu.uuid) else { continue };
        gpu.device_used_peak = gpu.device_used_peak.max(slot.device.load(Ordering::Relaxed));
        if let Some(peak) = gpu.process_used_peak.as_mut() {
            *peak = (*peak).max(slot.process.load(Ordering::Relaxed));
        }
        gpu.children_used_peak = gpu.children_used_peak.max(slot.children.load(Ordering::Relaxed));
    }
}

/// Starts new windows at the snapshot's current values.
pub fn reset(snapshot: &Snapshot) {
    let running = running();
    let Some(run) = running.as_ref() else { return };
    if run.sources.host {
        run.peaks.host.store(snapshot.host.rss, Ordering::Relaxed);
    }
    for gpu in &snapshot.gpus {
        if let Some(slot) = run.peaks.gpus.iter().find(|s| s.uuid == gpu.uuid) {
            slot.device.store(gpu.device_used, Ordering::Relaxed);
            slot.process.store(gpu.process_used.unwrap_or(0), Ordering::Relaxed);
            slot.children.store(gpu.children_used, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host_only() -> Sources {
        Sources { host: true, gpus: Vec::new() }
    }

    fn snapshot() -> Snapshot {
        Snapshot { taken_at: 0.0, host: host::read(), gpus: Vec::new(), notes: Vec::new() }
    }

    #[test]
    fn sees_a_short_spike_and_stops_cleanly() {
        let _guard = host::tests::serial();
        INTERVAL_US.store(1000, Ordering::Relaxed);
        ensure(host_only());
        let start = snapshot();
        reset(&start);
        let spike: Vec<u8> = vec![1; 256 << 20];
        thread::sleep(Duration::from_millis(30));
        drop(spike);
        let mut later = snapshot();
        later.host.peak_rss = later.host.rss; // as if VmHWM had just been reset
        apply(&mut later);
        assert!(later.host.peak_rss >= start.host.rss + (200 << 20), "{later:?}");
        stop();
        assert!(!is_running());
    }

    #[test]
    fn restarts_only_when_asked_for_something_else() {
        let _guard = host::tests::serial();
        ensure(host_only());
        let first = running().as_ref().map(|r| r.handle.thread().id());
        ensure(host_only());
        assert_eq!(running().as_ref().map(|r| r.handle.thread().id()), first);
        ensure(Sources::default());
        assert!(!is_running());
    }

    #[test]
    fn the_interval_is_checked() {
        let refused = set_interval(Duration::from_micros(10)).unwrap_err();
        assert!(matches!(&refused, Error::InvalidArgument(m) if m.contains("sample_interval_ms")), "{refused:?}");
        assert!(set_interval(Duration::from_secs(61)).is_err());
    }
}
