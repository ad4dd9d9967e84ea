//! The timeline: a native thread records host and GPU figures at a fixed interval and writes
//! each sample as it goes (JSON Lines or CSV), so a crash loses at most one interval. Like the
//! peak sampler it never touches Python.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::fork::ProcessLocal;
use crate::locks::lock;
use crate::snapshot::nvml::{self, Activity, ProcessUse};
use crate::snapshot::{host, now, own_pids};

pub const MIN_INTERVAL: Duration = Duration::from_millis(1);
pub const MAX_INTERVAL: Duration = Duration::from_secs(3600);

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GpuSample {
    pub uuid: String,
    pub used: Option<u64>,
    pub total: Option<u64>,
    /// This process's memory on the device, as NVML lists it.
    pub process_used: Option<u64>,
    #[serde(flatten)]
    pub activity: Activity,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Seconds since the monitor started.
    pub t: f64,
    /// Seconds since the Unix epoch (RFC 3339 in JSON).
    #[serde(
        serialize_with = "crate::units::serialize_rfc3339",
        deserialize_with = "crate::units::deserialize_rfc3339"
    )]
    pub time: f64,
    pub cpu_percent: f32,
    pub rss: u64,
    pub available: u64,
    pub gpus: Vec<GpuSample>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    JsonLines,
    Csv,
}

impl Format {
    /// From the file's extension: `.jsonl` (or `.json`) and `.csv`.
    pub fn of(path: &Path) -> Result<Format> {
        match path.extension().and_then(|e| e.to_str()).map(str::to_ascii_lowercase).as_deref() {
            Some("jsonl") | Some("json") => Ok(Format::JsonLines),
            Some("csv") => Ok(Format::Csv),
            _ => Err(Error::InvalidArgument(format!("{}: name the file .jsonl (JSON Lines) or .csv", path.display()))),
        }
    }
}

/// One CSV row, and its header, with a column group per GPU.
fn csv_line(sample: &Sample, header: bool) -> String {
    let mut cells: Vec<String> = if header {
        ["t", "time", "cpu_percent", "rss", "available"].map(String::from).to_vec()
    } else {
        vec![
            format!("{:.6}", sample.t),
            format!("{:.6}", sample.time),
            format!("{:.1}", sample.cpu_percent),
            sample.rss.to_string(),
            sample.available.to_string(),
        ]
    };
    let opt = |v: Option<String>| v.unwrap_or_default();
    for (i, gpu) in sample.gpus.iter().enumerate() {
        if header {
            for field in
                ["used", "total", "process_used", "utilization", "memory_utilization", "temperature_c", "power_w"]
            {
                cells.push(format!("gpu{i}_{field}"));
            }
        } else {
            let a = gpu.activity;
            cells.extend([
                opt(gpu.used.map(|v| v.to_string())),
                opt(gpu.total.map(|v| v.to_string())),
                opt(gpu.process_used.map(|v| v.to_string())),
                opt(a.utilization.map(|v| v.to_string())),
                opt(a.memory_utilization.map(|v| v.to_string())),
                opt(a.temperature_c.map(|v| v.to_string())),
                opt(a.power_w.map(|v| format!("{v:.1}"))),
            ]);
        }
    }
    cells.join(",")
}

struct Sink {
    writer: BufWriter<File>,
    format: Format,
    wrote_header: bool,
}

impl Sink {
    fn write(&mut self, sample: &Sample) -> std::io::Result<()> {
        match self.format {
            Format::JsonLines => {
                serde_json::to_writer(&mut self.writer, sample)?;
                self.writer.write_all(b"\n")?;
            }
            Format::Csv => {
                if !self.wrote_header {
                    writeln!(self.writer, "{}", csv_line(sample, true))?;
                    self.wrote_header = true;
                }
                writeln!(self.writer, "{}", csv_line(sample, false))?;
            }
        }
        // Flushed every sample: a crash loses at most one interval.
        self.writer.flush()
    }
}

pub struct Monitor {
    stop: Arc<AtomicBool>,
    /// A forked child holds a copy of this monitor but not the thread, which it must never join.
    handle: Option<ProcessLocal<JoinHandle<()>>>,
    samples: Arc<Mutex<Vec<Sample>>>,
    failure: Arc<Mutex<Option<String>>>,
}

impl Monitor {
    /// What `start` refuses, judged without writing anything: a bad interval, a file of unknown
    /// kind, or one that can't be written. `gpuexp.Monitor(...)` calls it when it is made, so a
    /// mistake shows there rather than at `start()`.
    pub fn check(interval: Duration, path: Option<&Path>) -> Result<()> {
        if !(MIN_INTERVAL..=MAX_INTERVAL).contains(&interval) {
            return Err(Error::InvalidArgument(format!(
                "interval must be between 1 ms and 1 hour, e.g. Monitor(interval=\"100ms\"); got {:.3} s",
                interval.as_secs_f64()
            )));
        }
        let Some(path) = path else { return Ok(()) };
        Format::of(path)?;
        // stat() never waits for a reader, as opening a FIFO for writing would.
        if let Ok(meta) = std::fs::metadata(path) {
            refuse_special(path, &meta)?;
        }
        let exists = path.exists();
        let target = if exists {
            path.to_path_buf()
        } else {
            path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new(".")).to_path_buf()
        };
        let writable = std::ffi::CString::new(target.as_os_str().as_encoded_bytes())
            // SAFETY: a valid NUL-terminated path; access() only reads it.
            .is_ok_and(|c| unsafe { libc::access(c.as_ptr(), libc::W_OK) } == 0);
        if !writable || (exists && path.is_dir()) {
            return Err(Error::Io(format!(
                "{}: cannot write there; name a file in a directory you can write to",
                path.display()
            )));
        }
        Ok(())
    }

    /// Checks everything before the thread starts: the interval, and that `path` can be written.
    pub fn start(interval: Duration, path: Option<PathBuf>, gpus: bool) -> Result<Monitor> {
        Self::check(interval, path.as_deref())?;
        let sink = match path {
            Some(path) => {
                let format = Format::of(&path)?;
                Some(Sink { writer: BufWriter::new(open_timeline(&path)?), format, wrote_header: false })
            }
            None => None,
        };
        let uuids = if gpus { nvml::visible_uuids().unwrap_or_default() } else { Vec::new() };
        let stop = Arc::new(AtomicBool::new(false));
        let samples = Arc::new(Mutex::new(Vec::new()));
        let failure = Arc::new(Mutex::new(None));
        let (thread_stop, thread_samples, thread_failure) = (stop.clone(), samples.clone(), failure.clone());
        let handle = thread::Builder::new()
            .name("gpuexp-monitor".into())
            .spawn(move || record(interval, sink, uuids, &thread_stop, &thread_samples, &thread_failure))
            .map_err(|e| Error::Io(format!("the monitor thread could not start: {e}")))?;
        Ok(Monitor { stop, handle: Some(ProcessLocal::new(handle)), samples, failure })
    }

    pub fn samples(&self) -> Vec<Sample> {
        lock(&self.samples).clone()
    }

    /// Why the monitor stopped writing, if it had to.
    pub fn failure(&self) -> Option<String> {
        lock(&self.failure).clone()
    }

    pub fn is_running(&self) -> bool {
        self.handle.as_ref().and_then(ProcessLocal::get).is_some_and(|h| !h.is_finished())
    }

    pub fn stop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        let Some(handle) = self.handle.take().and_then(ProcessLocal::into_inner) else { return };
        handle.thread().unpark();
        let _ = handle.join();
    }
}

impl Drop for Monitor {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A timeline goes to a regular file only: a FIFO without a reader would block its writer,
/// and a device or socket is no timeline.
const REGULAR_ONLY: &str = "the monitor writes its timeline to a regular file; name a new .jsonl or .csv file";

fn refuse_special(path: &Path, meta: &std::fs::Metadata) -> Result<()> {
    crate::files::refuse_special(path, meta, REGULAR_ONLY)
}

/// Opens (creates or truncates) the timeline file without ever waiting: O_NONBLOCK makes a
/// FIFO without a reader fail at once instead of blocking, and what was opened is checked
/// before anything is written, so a special file that appeared after `check` is refused too.
fn open_timeline(path: &Path) -> Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let cannot = |e: std::io::Error| Error::Io(format!("{}: cannot write there ({e})", path.display()));
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ENXIO) => Error::InvalidArgument(format!(
                "{} is a FIFO (named pipe), not a regular file: {REGULAR_ONLY}",
                path.display()
            )),
            _ => cannot(e),
        })?;
    refuse_special(path, &file.metadata().map_err(cannot)?)?;
    // Writes to a regular file never wait; the flag is cleared so the file behaves as one opened plainly.
    // SAFETY: fcntl on a descriptor this function owns.
    unsafe {
        let fd = std::os::fd::AsRawFd::as_raw_fd(&file);
        libc::fcntl(fd, libc::F_SETFL, libc::fcntl(fd, libc::F_GETFL) & !libc::O_NONBLOCK);
    }
    Ok(file)
}

fn record(
    interval: Duration,
    mut sink: Option<Sink>,
    uuids: Vec<String>,
    stop: &AtomicBool,
    samples: &Mutex<Vec<Sample>>,
    failure: &Mutex<Option<String>>,
) {
    let devices: Vec<_> = uuids.iter().map(|uuid| nvml::open(uuid).ok()).collect();
    let pids = own_pids();
    let started = Instant::now();
    {
        let _fork_waits = crate::fork::reading();
        host::cpu_percent(); // the first reading only starts the measurement
    }
    let mut next = started;
    while !stop.load(Ordering::Relaxed) {
        // The host reads lock sysinfo's state: a fork in the middle of one would leave the
        // child's first host read waiting forever, so they are gated as NVML's are.
        let fork_waits = crate::fork::reading();
        let reading = host::read();
        let cpu_percent = host::cpu_percent();
        let gpus: Vec<GpuSample> = uuids
            .iter()
            .zip(&devices)
            .map(|(uuid, device)| {
                let memory = device.as_ref().and_then(|d| nvml::read(d, &pids).ok());
                GpuSample {
                    uuid: uuid.clone(),
                    used: memory.map(|m| m.used),
                    total: memory.map(|m| m.total),
                    process_used: memory.and_then(|m| match m.process {
                        ProcessUse::Listed(bytes) => Some(bytes),
                        ProcessUse::NotListed => Some(0),
                        ProcessUse::Unreported => None,
                    }),
                    activity: device.as_ref().map(nvml::activity).unwrap_or_default(),
                }
            })
            .collect();
        let sample = Sample {
            t: started.elapsed().as_secs_f64(),
            time: now(),
            cpu_percent,
            rss: reading.rss,
            available: reading.available,
            gpus,
        };
        if let Some(writer) = sink.as_mut() {
            if let Err(e) = writer.write(&sample) {
                *lock(failure) = Some(format!("writing the timeline failed: {e}"));
                sink = None;
            }
        }
        lock(samples).push(sample);
        // Released only now: a fork copies the samples' and failure's locks too.
        drop(fork_waits);
        // Sleep to the next tick, not for a whole interval after this one's work.
        next += interval;
        let wait = next.saturating_duration_since(Instant::now());
        if !wait.is_zero() {
            thread::park_timeout(wait);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("gpuexp-monitor-{}-{name}", std::process::id()))
    }

    #[test]
    fn records_at_its_interval_and_writes_json_lines_as_it_goes() {
        let path = scratch("timeline.jsonl");
        let mut monitor = Monitor::start(Duration::from_millis(10), Some(path.clone()), false).unwrap();
        thread::sleep(Duration::from_millis(120));
        let written_while_running = std::fs::read_to_string(&path).unwrap().lines().count();
        monitor.stop();
        let samples = monitor.samples();
        assert!((8..=14).contains(&samples.len()), "{} samples", samples.len());
        assert!(written_while_running >= 8, "the file is flushed as it goes");
        let first: serde_json::Value =
            serde_json::from_str(std::fs::read_to_string(&path).unwrap().lines().next().unwrap()).unwrap();
        assert!(first["rss"].as_u64().unwrap() > 0 && first["gpus"].as_array().unwrap().is_empty());
        assert!(samples.windows(2).all(|w| w[1].t > w[0].t));
        std::fs::remove_file(path).ok();
    }

    #[test]
    fn csv_has_a_header_and_a_row_per_sample() {
        let path = scratch("timeline.csv");
        let mut monitor = Monitor::start(Duration::from_millis(5), Some(path.clone()), false).unwrap();
        thread::sleep(Duration::from_millis(40));
        monitor.stop();
        let text = std::fs::read_to_string(&path).unwrap();
        let mut lines = text.lines();
        assert_eq!(lines.next(), Some("t,time,cpu_percent,rss,available"));
        assert_eq!(lines.count(), monitor.samples().len());
        std::fs::remove_file(path).ok();
    }

    #[test]
    fn bad_input_is_refused_before_any_thread_starts() {
        let refused = |interval, path: Option<PathBuf>| Monitor::start(interval, path, false).err().unwrap();
        assert!(matches!(refused(Duration::ZERO, None), Error::InvalidArgument(m) if m.contains("interval")));
        let unwritable = refused(Duration::from_millis(10), Some("/nonexistent/dir/t.jsonl".into()));
        assert!(
            matches!(&unwritable, Error::Io(m) if m.contains("/nonexistent/dir/t.jsonl: cannot write")),
            "{unwritable:?}"
        );
        let unknown = refused(Duration::from_millis(10), Some(scratch("t.txt")));
        assert!(matches!(&unknown, Error::InvalidArgument(m) if m.contains(".jsonl")), "{unknown:?}");
    }

    #[test]
    fn a_fifo_or_device_is_refused_without_waiting_for_a_reader() {
        let fifo = scratch("fifo.jsonl");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let started = Instant::now();
        let checked = Monitor::check(Duration::from_millis(10), Some(&fifo)).err().unwrap();
        assert!(matches!(&checked, Error::InvalidArgument(m) if m.contains("FIFO")), "{checked:?}");
        // What `check` let through is refused at open too, without blocking on the missing reader.
        let opened = open_timeline(&fifo).err().unwrap();
        assert!(matches!(&opened, Error::InvalidArgument(m) if m.contains("FIFO")), "{opened:?}");
        assert!(started.elapsed() < Duration::from_secs(1));
        std::fs::remove_file(&fifo).unwrap();
        let null = refuse_special(Path::new("/dev/null"), &std::fs::metadata("/dev/null").unwrap());
        assert!(matches!(null, Err(Error::InvalidArgument(m)) if m.contains("a device")));
    }

    #[test]
    fn csv_columns_per_gpu() {
        let gpu = GpuSample {
            uuid: "GPU-a".into(),
            used: Some(5),
            total: Some(10),
            process_used: Some(2),
            activity: Activity {
                utilization: Some(50),
                memory_utilization: Some(7),
                temperature_c: Some(40),
                power_w: Some(120.5),
            },
        };
        let sample = Sample { t: 1.0, time: 2.0, cpu_percent: 3.0, rss: 4, available: 5, gpus: vec![gpu] };
        assert!(csv_line(&sample, true).ends_with("gpu0_temperature_c,gpu0_power_w"));
        assert!(csv_line(&sample, false).ends_with(",5,10,2,50,7,40,120.5"), "{}", csv_line(&sample, false));
    }
}
