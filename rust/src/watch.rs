//! `gpuexp watch`: a refresh every interval, as a live view, CSV rows or JSON lines.
//!
//! It opens its devices once; a refresh then reads only what changes (memory, utilisation,
//! temperature, power) from the kept handles, formats it and writes it, all here: a live view that
//! runs for hours should cost little more than the NVML reads themselves.

use std::fs::File;
use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::error::{Error, Result};
use crate::snapshot::nvml::{self, DeviceStatus, Listed};
use crate::status::{device_line, order_label};

/// How `watch` prints each refresh.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Style {
    /// A header and one line per device, for a person.
    Live,
    /// `nvidia-smi --query-gpu=... --format=csv -l` style rows.
    Csv,
    /// The same rows as JSON, one object per line.
    JsonLines,
}

impl std::str::FromStr for Style {
    type Err = Error;

    /// `"live"`, `"csv"` or `"json"`, as the command's options name them.
    fn from_str(style: &str) -> Result<Style> {
        match style {
            "live" => Ok(Style::Live),
            "csv" => Ok(Style::Csv),
            "json" => Ok(Style::JsonLines),
            other => Err(Error::InvalidArgument(format!("style {other:?}: use \"live\", \"csv\" or \"json\""))),
        }
    }
}

/// The time between refreshes, refused unless it is more than 0 seconds.
pub fn refresh_interval(seconds: f64) -> Result<Duration> {
    Duration::try_from_secs_f64(seconds).ok().filter(|i| !i.is_zero()).ok_or_else(|| {
        Error::InvalidArgument(format!("the interval must be more than 0 seconds, e.g. 1; got {seconds}"))
    })
}

pub const CSV_HEADER: &str = "timestamp,index,name,utilization,memory_used,memory_total,temperature_c,power_w";

/// A row of the `--csv` and `--json` logs; the field names are CSV_HEADER's.
#[derive(Serialize)]
struct Row<'a> {
    timestamp: &'a str,
    index: u32,
    name: &'a str,
    utilization: Option<u32>,
    memory_used: u64,
    memory_total: u64,
    temperature_c: Option<u32>,
    power_w: Option<f64>,
}

impl<'a> Row<'a> {
    fn of(d: &'a DeviceStatus, timestamp: &'a str) -> Row<'a> {
        Row {
            timestamp,
            index: d.index,
            name: &d.name,
            utilization: d.activity.utilization,
            memory_used: d.used,
            memory_total: d.total,
            temperature_c: d.activity.temperature_c,
            power_w: d.activity.power_w,
        }
    }

    fn csv(&self) -> String {
        fn cell<T: ToString>(value: Option<T>) -> String {
            value.map(|v| v.to_string()).unwrap_or_default()
        }
        format!(
            "{},{},{},{},{},{},{},{}",
            self.timestamp,
            self.index,
            self.name,
            cell(self.utilization),
            self.memory_used,
            self.memory_total,
            cell(self.temperature_c),
            cell(self.power_w.map(|w| format!("{w:.2}")))
        )
    }
}

pub struct Watch {
    devices: Vec<Listed>,
    style: Style,
    interval: Duration,
    /// What the live view's first line says after the time: the interval and the device order.
    heading: String,
}

/// Where a watch writes: standard output, and a log file when asked.
pub struct Output {
    screen: Box<dyn Write>,
    /// Written before each refresh on a terminal, so the live view redraws in place.
    screen_prefix: &'static str,
    /// The log, with its path for the message if writing fails.
    log: Option<(File, PathBuf)>,
}

impl Output {
    /// Opens the log for appending; `redraw` clears the screen before each refresh.
    pub fn open(log: Option<&Path>, redraw: bool) -> Result<Output> {
        let log = log
            .map(|path| match File::options().create(true).append(true).open(path) {
                Ok(file) => Ok((file, path.to_path_buf())),
                Err(e) => Err(Error::Io(format!("--log {}: cannot write there ({e})", path.display()))),
            })
            .transpose()?;
        Ok(Output {
            screen: Box::new(std::io::stdout()),
            screen_prefix: if redraw { "\x1b[H\x1b[2J" } else { "" },
            log,
        })
    }

    /// False when standard output has closed (`gpuexp watch --csv | head`): the watch is over.
    fn emit(&mut self, text: &str) -> Result<bool> {
        // One write each: the log is an unbuffered file, and a half-written refresh is never seen.
        let line = format!("{}{text}\n", self.screen_prefix);
        match self.screen.write_all(line.as_bytes()).and_then(|()| self.screen.flush()) {
            Err(e) if e.kind() == ErrorKind::BrokenPipe => return Ok(false),
            Err(e) => return Err(Error::Io(format!("writing to standard output failed: {e}"))),
            Ok(()) => {}
        }
        if let Some((log, path)) = self.log.as_mut() {
            log.write_all(&line.as_bytes()[self.screen_prefix.len()..])
                .map_err(|e| Error::Io(format!("writing the log {} failed: {e}", path.display())))?;
        }
        Ok(true)
    }
}

impl Watch {
    /// Opens the devices; with no driver this fails before anything is printed.
    pub fn open(cuda_order: bool, style: Style, interval: Duration) -> Result<Watch> {
        Ok(Watch { devices: nvml::list_devices(cuda_order)?, style, interval, heading: heading(interval, cuda_order) })
    }

    /// One refresh, every device read now, stamped with `timestamp`.
    fn refresh(&self, timestamp: &str) -> Result<String> {
        let devices = self.devices.iter().map(|d| d.status(false)).collect::<Result<Vec<_>>>()?;
        Ok(render(&devices, self.style, &self.heading, timestamp))
    }

    /// Refreshes every interval until `wait(time left)` says stop (it returns false) or standard
    /// output closes. `wait` sleeps, and is where the caller notices Ctrl-C.
    pub fn run(&self, output: &mut Output, mut wait: impl FnMut(Duration) -> bool) -> Result<()> {
        if self.style == Style::Csv && !output.emit(CSV_HEADER)? {
            return Ok(());
        }
        loop {
            let started = Instant::now();
            if !output.emit(&self.refresh(&local_timestamp())?)? {
                return Ok(());
            }
            // Woken early by a signal, `wait` is called again for what is left.
            loop {
                let left = self.interval.saturating_sub(started.elapsed());
                if !wait(left) {
                    return Ok(());
                }
                if started.elapsed() >= self.interval {
                    break;
                }
            }
        }
    }
}

/// Sleeps for `duration` or until a signal arrives, whichever comes first. Not `thread::sleep`,
/// which sleeps on through signals: Ctrl-C must stop a watch at once, not after its interval.
pub fn nap(duration: Duration) {
    let request = libc::timespec {
        tv_sec: duration.as_secs().min(libc::time_t::MAX as u64) as libc::time_t,
        tv_nsec: duration.subsec_nanos().into(),
    };
    // SAFETY: both pointers are valid for the call; a null remainder is allowed.
    unsafe { libc::nanosleep(&request, std::ptr::null_mut()) };
}

/// Now in local time, as nvidia-smi stamps its log: "2026/11/21 12:00:00".
fn local_timestamp() -> String {
    // SAFETY: localtime_r writes only into `tm`, which lives on this stack; `now` is a valid time_t.
    let tm = unsafe {
        let now = libc::time(std::ptr::null_mut());
        let mut tm: libc::tm = std::mem::zeroed();
        libc::localtime_r(&now, &mut tm);
        tm
    };
    format!(
        "{:04}/{:02}/{:02} {:02}:{:02}:{:02}",
        tm.tm_year + 1900,
        tm.tm_mon + 1,
        tm.tm_mday,
        tm.tm_hour,
        tm.tm_min,
        tm.tm_sec
    )
}

fn heading(interval: Duration, cuda_order: bool) -> String {
    format!("every {} s · {} · Ctrl-C stops", interval.as_secs_f64(), order_label(cuda_order))
}

fn render(devices: &[DeviceStatus], style: Style, heading: &str, timestamp: &str) -> String {
    let lines: Vec<String> = match style {
        Style::Live => std::iter::once(format!("gpuexp watch · {timestamp} · {heading}"))
            .chain(devices.iter().map(device_line))
            .collect(),
        Style::Csv => devices.iter().map(|d| Row::of(d, timestamp).csv()).collect(),
        Style::JsonLines => devices
            .iter()
            .map(|d| serde_json::to_string(&Row::of(d, timestamp)).expect("a row always serialises"))
            .collect(),
    };
    lines.join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::nvml::Activity;
    use crate::status::testing::device;

    #[test]
    fn a_style_and_an_interval_are_read_as_the_command_gives_them() {
        assert_eq!("json".parse::<Style>(), Ok(Style::JsonLines));
        let refused = "xml".parse::<Style>().unwrap_err().to_string();
        assert_eq!(refused, "style \"xml\": use \"live\", \"csv\" or \"json\"");
        assert_eq!(refresh_interval(0.5), Ok(Duration::from_millis(500)));
        for bad in [0.0, -1.0, f64::NAN] {
            assert!(refresh_interval(bad).unwrap_err().to_string().starts_with("the interval must be more than 0"));
        }
    }

    const BUSY: Activity = Activity {
        utilization: Some(97),
        memory_utilization: Some(40),
        temperature_c: Some(61),
        power_w: Some(512.34),
    };

    #[test]
    fn csv_rows_follow_the_header_and_leave_unreported_figures_empty() {
        let quiet = Activity::default();
        let text = render(&[device(0, BUSY), device(1, quiet)], Style::Csv, "", "2026/11/21 12:00:00");
        let rows: Vec<&str> = text.lines().collect();
        assert_eq!(rows[0], format!("2026/11/21 12:00:00,0,NVIDIA H200,97,{},{},61,512.34", 3u64 << 30, 140u64 << 30));
        assert_eq!(rows[1].split(',').count(), CSV_HEADER.split(',').count());
        assert!(rows[1].ends_with(&format!(",,{},{},,", 3u64 << 30, 140u64 << 30)), "{}", rows[1]);
    }

    #[test]
    fn json_rows_carry_the_csv_columns() {
        let text = render(&[device(0, BUSY)], Style::JsonLines, "", "t");
        let row: serde_json::Value = serde_json::from_str(&text).unwrap();
        let keys: Vec<&str> = row.as_object().unwrap().keys().map(String::as_str).collect();
        let mut expected: Vec<&str> = CSV_HEADER.split(',').collect();
        expected.sort();
        assert_eq!(keys, expected);
        assert_eq!(row["utilization"], 97);
    }

    #[test]
    fn the_live_view_has_a_header_and_a_line_per_device() {
        let text = render(
            &[device(0, BUSY), device(1, BUSY)],
            Style::Live,
            &heading(Duration::from_millis(500), false),
            "12:00",
        );
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], "gpuexp watch · 12:00 · every 0.5 s · NVML order · Ctrl-C stops");
        assert_eq!(lines[2], "[1] NVIDIA H200 · 3.00 GiB / 140.00 GiB · 97% · 61 °C · 512 W · GPU-1");
    }

    fn scratch(name: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("gpuexp-watch-{}-{name}", std::process::id()))
    }

    fn watch(style: Style, interval: Duration) -> Watch {
        Watch { devices: Vec::new(), style, interval, heading: heading(interval, true) }
    }

    #[test]
    fn a_watch_refreshes_until_told_to_stop_and_logs_without_the_redraw() {
        let (screen, log) = (scratch("screen"), scratch("log.txt"));
        let mut output = Output::open(Some(&log), true).unwrap();
        output.screen = Box::new(File::create(&screen).unwrap());
        let mut waits = 0;
        watch(Style::Live, Duration::from_millis(2))
            .run(&mut output, |left| {
                waits += 1;
                nap(left);
                waits < 3
            })
            .unwrap();
        let logged = std::fs::read_to_string(&log).unwrap();
        assert_eq!(logged.lines().count(), 3, "{logged}");
        assert!(logged.lines().all(|l| l.starts_with("gpuexp watch · 20")
            && l.ends_with("every 0.002 s · CUDA order (CUDA_VISIBLE_DEVICES) · Ctrl-C stops")));
        assert_eq!(std::fs::read_to_string(&screen).unwrap().matches("\x1b[H\x1b[2J").count(), 3);
        std::fs::remove_file(screen).ok();
        std::fs::remove_file(log).ok();
    }

    #[test]
    fn waking_early_does_not_refresh_early() {
        let log = scratch("early.txt");
        let mut output = Output::open(Some(&log), false).unwrap();
        output.screen = Box::new(std::io::sink());
        let mut waits = 0;
        watch(Style::Csv, Duration::from_millis(30))
            .run(&mut output, |left| {
                waits += 1;
                if waits > 2 {
                    nap(left); // the first two waits return at once, as a signal would end them
                }
                waits < 4
            })
            .unwrap();
        let logged = std::fs::read_to_string(&log).unwrap();
        assert_eq!(logged.lines().next(), Some(CSV_HEADER));
        assert_eq!(logged.lines().count(), 1 + 2, "two refreshes (no devices: empty rows) in four waits: {logged:?}");
        std::fs::remove_file(log).ok();
    }

    struct ClosedPipe;

    impl Write for ClosedPipe {
        fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
            Err(ErrorKind::BrokenPipe.into())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_closed_output_ends_the_watch_quietly() {
        let mut output = Output::open(None, false).unwrap();
        output.screen = Box::new(ClosedPipe);
        let mut waits = 0;
        watch(Style::JsonLines, Duration::from_millis(1))
            .run(&mut output, |_| {
                waits += 1;
                true
            })
            .unwrap();
        assert_eq!(waits, 0);
    }

    #[test]
    fn a_log_that_cannot_be_written_stops_the_watch_and_names_the_log() {
        let mut output = Output::open(Some(Path::new("/dev/full")), false).unwrap();
        output.screen = Box::new(std::io::sink());
        let failed = watch(Style::Csv, Duration::from_millis(1)).run(&mut output, |_| true).unwrap_err();
        assert!(matches!(&failed, Error::Io(m) if m.starts_with("writing the log /dev/full failed")), "{failed:?}");
    }

    #[test]
    fn an_unwritable_log_is_an_io_error_that_names_the_path() {
        let refused = Output::open(Some(Path::new("/nonexistent/dir/w.csv")), false).err().unwrap();
        assert!(
            matches!(&refused, Error::Io(m) if m.starts_with("--log /nonexistent/dir/w.csv: cannot write there")),
            "{refused:?}"
        );
    }
}
