//! Host memory of this process and of the system, cheap enough to read on every snapshot.

use std::sync::{Mutex, OnceLock};

use sysinfo::System;

use crate::locks::lock;

#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct HostReading {
    /// Bytes, current resident set of this process.
    pub rss: u64,
    /// Bytes, the kernel's high-water mark (VmHWM) since the last `reset_peak()`.
    pub peak_rss: u64,
    /// Bytes, system available memory, capped by the cgroup's headroom when a limit applies.
    pub available: u64,
    /// Bytes, system total memory.
    pub total: u64,
    /// Bytes, the memory limit of this process's cgroup; None when unlimited or unknown.
    pub cgroup_limit: Option<u64>,
}

/// One reading. Never panics; a field it cannot read is 0 (or None).
pub fn read() -> HostReading {
    let (rss, peak_rss) = imp::process_memory();
    let (total, available) = with_system(|sys| {
        sys.refresh_memory();
        (sys.total_memory(), sys.available_memory())
    })
    .unwrap_or_default();
    let (available, cgroup_limit) = imp::cgroup_cap(total, available);
    HostReading { rss, peak_rss, available, total, cgroup_limit }
}

/// This process's memory only (RSS and its peak), the system's figures left 0: what a cell's
/// record needs, without parsing /proc/meminfo twice in every cell.
pub fn read_process() -> HostReading {
    let (rss, peak_rss) = imp::process_memory();
    HostReading { rss, peak_rss, ..HostReading::default() }
}

/// Current RSS only, as cheap as possible (for a sampler thread).
pub fn read_rss() -> u64 {
    imp::read_rss()
}

/// Resets the kernel's peak RSS (VmHWM) to the current RSS, `last` being the reading the new
/// window starts at; false where that does not work.
pub fn reset_peak(last: &HostReading) -> bool {
    peak_reset_supported() && imp::reset_peak(last)
}

/// Whether `reset_peak()` works here (probes once, cached).
///
/// `GPUEXP_HOST_PEAK=sampled` skips the probe and uses the sampler, for kernels that accept
/// the reset but report nonsense afterwards.
pub fn peak_reset_supported() -> bool {
    static SUPPORTED: OnceLock<bool> = OnceLock::new();
    *SUPPORTED.get_or_init(|| std::env::var("GPUEXP_HOST_PEAK").as_deref() != Ok("sampled") && imp::probe_peak_reset())
}

/// System-wide CPU use in percent since the previous call (the first call reads 0).
pub fn cpu_percent() -> f32 {
    with_system(|system| {
        system.refresh_cpu_usage();
        system.global_cpu_usage()
    })
    .unwrap_or(0.0)
}

fn with_system<T>(f: impl FnOnce(&mut System) -> T) -> Option<T> {
    static SYSTEM: OnceLock<Option<Mutex<System>>> = OnceLock::new();
    let system = SYSTEM.get_or_init(|| System::new().ok().map(Mutex::new)).as_ref()?;
    let mut system = lock(system);
    Some(f(&mut system))
}

#[cfg(target_os = "linux")]
mod imp {
    use std::cell::RefCell;
    use std::fs::{File, OpenOptions};
    use std::os::unix::fs::FileExt;
    use std::path::{Path, PathBuf};
    use std::sync::OnceLock;
    use std::thread::LocalKey;

    use crate::fork::PerProcess;

    unsafe extern "C" {
        fn sysconf(name: i32) -> i64;
        fn mmap(addr: *mut u8, len: usize, prot: i32, flags: i32, fd: i32, off: i64) -> *mut u8;
        fn munmap(addr: *mut u8, len: usize) -> i32;
    }
    const SC_PAGESIZE: i32 = 30;
    const PROT_RW: i32 = 0x1 | 0x2;
    const MAP_PRIVATE_ANON_POPULATE: i32 = 0x02 | 0x20 | 0x8000;

    type Cached = RefCell<Option<(u32, File)>>;
    // Keeping the procfs files open and re-reading (or re-writing) them at offset 0 makes the
    // kernel regenerate them without the open/close path walk (statm: ~1 µs instead of ~5 µs).
    // Per thread so no lock is taken; keyed by pid so a forked child reopens its own.
    thread_local! {
        static STATUS: Cached = const { RefCell::new(None) };
        static STATM: Cached = const { RefCell::new(None) };
        static CLEAR_REFS: Cached = const { RefCell::new(None) };
    }

    fn with_self<T>(
        key: &'static LocalKey<Cached>,
        path: &str,
        open: fn(&str) -> std::io::Result<File>,
        f: impl FnOnce(&File) -> std::io::Result<T>,
    ) -> Option<T> {
        let pid = crate::fork::pid();
        key.try_with(|cell| {
            let mut slot = cell.try_borrow_mut().ok()?;
            if slot.as_ref().is_none_or(|(owner, _)| *owner != pid) {
                *slot = Some((pid, open(path).ok()?));
            }
            f(&slot.as_ref()?.1).ok()
        })
        .ok()
        .flatten()
    }

    fn read_self(key: &'static LocalKey<Cached>, path: &str, buf: &mut [u8]) -> usize {
        with_self(key, path, |path| File::open(path), |file| file.read_at(buf, 0)).unwrap_or(0)
    }

    fn parse_u64(bytes: &[u8]) -> u64 {
        let digits = bytes.iter().skip_while(|b| !b.is_ascii_digit());
        digits
            .take_while(|b| b.is_ascii_digit())
            .fold(0u64, |n, b| n.saturating_mul(10).saturating_add(u64::from(b - b'0')))
    }

    fn kb_field(text: &[u8], key: &[u8]) -> u64 {
        let line = text.split(|&b| b == b'\n').find_map(|line| line.strip_prefix(key));
        line.map_or(0, |rest| parse_u64(rest).saturating_mul(1024))
    }

    /// (RSS, peak RSS), the peak never below the RSS it is shown with. Where the last reset
    /// found getrusage's peak trustworthy, statm and getrusage: two cheap reads instead of
    /// /proc/self/status, which the kernel formats in full for every read (most of a cell
    /// log's cost was that one file).
    pub fn process_memory() -> (u64, u64) {
        if *RUSAGE_PEAK_TRUSTED.lock() {
            let rss = read_rss();
            return (rss, rusage_peak().max(rss));
        }
        let mut buf = [0u8; 4096];
        let len = read_self(&STATUS, "/proc/self/status", &mut buf);
        let text = &buf[..len];
        (kb_field(text, b"VmRSS:"), kb_field(text, b"VmHWM:"))
    }

    /// getrusage's peak is the larger of VmHWM and a floor that every exiting thread raises to
    /// the VmHWM of its time, which no reset lowers. A window may use it while the floor is no
    /// higher than the RSS the window starts at: the floor then never shows as a rise. Just
    /// after a reset that holds when getrusage's peak is no higher than the RSS read after it.
    /// When the window that just ended used getrusage and ended at its peak (`last`), it holds
    /// with no check, its exiting threads having raised the floor no higher than that; and
    /// VmHWM already is the RSS, so there is nothing to reset either (most cells end so).
    /// Otherwise status is read instead.
    pub fn reset_peak(last: &super::HostReading) -> bool {
        let mut trusted = RUSAGE_PEAK_TRUSTED.lock();
        if *trusted && last.peak_rss <= last.rss {
            return true;
        }
        if !write_clear_refs() {
            return false;
        }
        let peak = rusage_peak();
        *trusted = peak > 0 && peak <= read_rss();
        true
    }

    /// Whether this process's last reset found getrusage's peak trustworthy; a forked child
    /// reads status until its own reset.
    static RUSAGE_PEAK_TRUSTED: PerProcess<bool> = PerProcess::new(|| false);

    #[cfg(test)]
    pub fn rusage_peak_trusted() -> bool {
        *RUSAGE_PEAK_TRUSTED.lock()
    }

    pub(super) fn rusage_peak() -> u64 {
        let mut usage = std::mem::MaybeUninit::<libc::rusage>::zeroed();
        // SAFETY: getrusage fills the struct it is given, and RUSAGE_SELF is always valid.
        if unsafe { libc::getrusage(libc::RUSAGE_SELF, usage.as_mut_ptr()) } != 0 {
            return 0;
        }
        // SAFETY: zero-initialised, then filled by a successful call.
        let kib = unsafe { usage.assume_init() }.ru_maxrss;
        u64::try_from(kib).unwrap_or(0).saturating_mul(1024)
    }

    pub fn read_rss() -> u64 {
        let mut buf = [0u8; 128];
        let len = read_self(&STATM, "/proc/self/statm", &mut buf);
        let text = &buf[..len];
        let resident = text.split(|&b| b == b' ').nth(1).map_or(0, parse_u64);
        let page = unsafe { sysconf(SC_PAGESIZE) };
        resident.saturating_mul(u64::try_from(page).unwrap_or(0))
    }

    fn write_clear_refs() -> bool {
        let open = |path: &str| OpenOptions::new().write(true).open(path);
        with_self(&CLEAR_REFS, "/proc/self/clear_refs", open, |file| file.write_at(b"5", 0)) == Some(1)
    }

    /// Some kernels and sandboxes accept the write and ignore it, so the probe first lifts the
    /// peak above the RSS (mmap'd directly, as an allocator might keep freed memory resident)
    /// and then checks that the write brought it back down.
    pub fn probe_peak_reset() -> bool {
        const BUMP: u64 = 16 << 20;
        let len = BUMP as usize;
        let flags = MAP_PRIVATE_ANON_POPULATE;
        let bump = unsafe { mmap(std::ptr::null_mut(), len, PROT_RW, flags, -1, 0) };
        if bump as isize == -1 {
            return false;
        }
        unsafe { munmap(bump, len) };
        let (rss, peak) = process_memory();
        if peak < rss + BUMP / 2 || !write_clear_refs() {
            return false;
        }
        let (rss, peak) = process_memory();
        peak < rss + BUMP / 2
    }

    /// A cgroup level whose limit is below system RAM, with its usage file kept open for pread.
    struct Level {
        limit: u64,
        usage: File,
    }

    /// Caps `available` by the tightest headroom among this process's memory cgroup and its
    /// ancestors; returns it with the tightest limit. sysinfo's `System::cgroup_limits()` is not
    /// used: in 0.40 it reads only the root cgroup (missing e.g. `memory:/process_api/<id>`) and
    /// re-parses /proc/meminfo and memory.stat on each call (~38 µs here).
    pub fn cgroup_cap(total: u64, available: u64) -> (u64, Option<u64>) {
        static LEVELS: OnceLock<Vec<Level>> = OnceLock::new();
        let levels = LEVELS.get_or_init(|| cgroup_levels(total).unwrap_or_default());
        let headroom = levels.iter().map(|level| {
            let mut buf = [0u8; 32];
            let used = level.usage.read_at(&mut buf, 0).map_or(0, |n| parse_u64(&buf[..n]));
            level.limit.saturating_sub(used)
        });
        (headroom.fold(available, u64::min), levels.iter().map(|l| l.limit).min())
    }

    /// Limits are read once: they rarely change, and each extra cgroupfs read costs µs.
    fn cgroup_levels(total: u64) -> Option<Vec<Level>> {
        let cgroups = std::fs::read_to_string("/proc/self/cgroup").ok()?;
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
        // Hybrid hosts keep the memory controller on v1, so it wins over the v2 entry.
        let v1 = cgroups.lines().find_map(|l| {
            let (controllers, path) = l.split_once(':')?.1.split_once(':')?;
            controllers.split(',').any(|c| c == "memory").then_some(path)
        });
        let (path, v2) = match v1 {
            Some(path) => (path, false),
            None => (cgroups.lines().find_map(|l| l.strip_prefix("0::"))?, true),
        };
        let (limit_file, usage_file) =
            if v2 { ("memory.max", "memory.current") } else { ("memory.limit_in_bytes", "memory.usage_in_bytes") };
        let (mount, leaf) = mounts.lines().find_map(|l| {
            let (pre, post) = l.split_once(" - ")?;
            let (root, mount) = (pre.split(' ').nth(3)?, pre.split(' ').nth(4)?);
            let mut post = post.split(' ');
            let fstype = post.next()?;
            let memory = post.nth(1)?.split(',').any(|o| o == "memory");
            let matches = if v2 { fstype == "cgroup2" } else { fstype == "cgroup" && memory };
            // Without a cgroup namespace the mount's root is our own cgroup, not "/".
            let rel = Path::new(path).strip_prefix(root).ok().filter(|_| matches)?;
            Some((PathBuf::from(mount), Path::new(mount).join(rel)))
        })?;
        let levels = leaf.ancestors().take_while(|dir| dir.starts_with(&mount)).filter_map(|dir| {
            let text = std::fs::read_to_string(dir.join(limit_file)).ok()?;
            // v2 "max" and v1's near-i64::MAX both mean unlimited; a limit above RAM never binds.
            let limit = Some(parse_u64(text.as_bytes())).filter(|&l| l > 0 && l < total)?;
            Some(Level { limit, usage: File::open(dir.join(usage_file)).ok()? })
        });
        Some(levels.collect())
    }
}

#[cfg(not(target_os = "linux"))]
mod imp {
    use sysinfo::{ProcessRefreshKind, ProcessesToUpdate};

    pub fn process_memory() -> (u64, u64) {
        let rss = read_rss();
        (rss, rss)
    }

    pub fn read_rss() -> u64 {
        let Ok(pid) = sysinfo::get_current_pid() else {
            return 0;
        };
        super::with_system(|sys| {
            let kind = ProcessRefreshKind::nothing().with_memory();
            sys.refresh_processes_specifics(ProcessesToUpdate::Some(&[pid]), false, kind);
            sys.process(pid).map_or(0, |p| p.memory())
        })
        .unwrap_or(0)
    }

    pub fn cgroup_cap(_total: u64, available: u64) -> (u64, Option<u64>) {
        (available, None)
    }

    pub fn reset_peak(_last: &super::HostReading) -> bool {
        false
    }

    pub fn probe_peak_reset() -> bool {
        false
    }
}

/// The command line of a process, as far as this namespace can see it ("?" otherwise).
pub(crate) fn process_command(pid: u32) -> String {
    match std::fs::read(format!("/proc/{pid}/cmdline")) {
        Ok(raw) if !raw.is_empty() => {
            String::from_utf8_lossy(&raw).split('\0').filter(|a| !a.is_empty()).collect::<Vec<_>>().join(" ")
        }
        _ => "?".into(),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use std::time::Instant;

    const MIB: u64 = 1 << 20;
    // Tests run on parallel threads of one process, whose RSS they all move (the sampler's too).
    static SERIAL: Mutex<()> = Mutex::new(());

    pub(crate) fn serial() -> std::sync::MutexGuard<'static, ()> {
        lock(&SERIAL)
    }

    #[test]
    fn reading_is_consistent() {
        let _guard = serial();
        let r = read();
        assert!(r.rss > 0 && r.rss <= r.peak_rss, "{r:?}");
        assert!(r.total > 0 && r.available <= r.total, "{r:?}");
        assert!(r.cgroup_limit.is_none_or(|l| l > 0 && r.available <= l), "{r:?}");
        let rss = read_rss();
        assert!(rss.abs_diff(r.rss) < 4 * MIB, "statm {rss} vs status {}", r.rss);
    }

    #[test]
    fn allocation_moves_rss_and_reset_lowers_peak() {
        let _guard = serial();
        let before = read();
        let block = vec![1u8; 200 * MIB as usize];
        let during = read();
        let grown = during.rss.saturating_sub(before.rss);
        assert!(grown.abs_diff(200 * MIB) < 16 * MIB, "grew by {} MiB", grown / MIB);
        assert!(during.peak_rss >= 200 * MIB);
        drop(std::hint::black_box(block));
        let supported = peak_reset_supported();
        println!("peak_reset_supported: {supported}");
        assert_eq!(reset_peak(&read()), supported);
        let after = read();
        assert!(after.rss < during.rss - 150 * MIB, "{after:?}");
        if supported {
            assert!(after.peak_rss < after.rss + 8 * MIB, "{after:?}");
        }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn after_a_reset_the_cheap_peak_is_vmhwm() {
        let _guard = serial();
        if !peak_reset_supported() {
            return;
        }
        let vmhwm = || {
            let status = std::fs::read_to_string("/proc/self/status").unwrap();
            let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
            line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
        };
        let reading = || {
            let (rss, peak_rss) = imp::process_memory();
            HostReading { rss, peak_rss, ..HostReading::default() }
        };
        // Exited test threads may have left getrusage's floor above the RSS: rise above it first
        // (again if a test on another thread moved it meanwhile).
        let mut lift = Vec::new();
        for _ in 0..10 {
            lift = vec![1u8; imp::rusage_peak().saturating_sub(read_rss()) as usize + 16 * MIB as usize];
            assert!(reset_peak(&HostReading { peak_rss: u64::MAX, ..HostReading::default() }));
            if imp::rusage_peak_trusted() {
                break;
            }
        }
        assert!(imp::rusage_peak_trusted(), "the reset should trust getrusage with the RSS above its floor");
        // A window that ended at its peak needs neither a reset nor a check.
        assert!(reset_peak(&HostReading { rss: 1, peak_rss: 1, ..HostReading::default() }));
        assert!(imp::rusage_peak_trusted());
        let start = read_rss();
        drop(std::hint::black_box(vec![1u8; 100 * MIB as usize]));
        let spiked = reading();
        let exact = vmhwm();
        assert!(spiked.peak_rss >= start + 90 * MIB && spiked.peak_rss >= spiked.rss, "{spiked:?} from {start}");
        assert!(spiked.peak_rss.abs_diff(exact) < MIB, "cheap peak {spiked:?} vs VmHWM {exact}");
        drop(std::hint::black_box(lift));
        // After a fall the reset checks again; whichever way that goes, the peak is VmHWM's.
        assert!(reset_peak(&reading()));
        let after = reading();
        assert!(after.peak_rss >= after.rss && after.peak_rss.abs_diff(vmhwm()) < MIB, "after the drop: {after:?}");
    }

    #[test]
    fn timing() {
        let _guard = serial();
        const N: u32 = 10_000;
        let mut sink = 0u64;
        let start = Instant::now();
        for _ in 0..N {
            sink = sink.wrapping_add(read().rss);
        }
        let read_us = start.elapsed().as_secs_f64() * 1e6 / f64::from(N);
        let start = Instant::now();
        for _ in 0..N {
            sink = sink.wrapping_add(read_rss());
        }
        let rss_us = start.elapsed().as_secs_f64() * 1e6 / f64::from(N);
        let start = Instant::now();
        for _ in 0..N {
            sink = sink.wrapping_add(
                with_system(|s| {
                    s.refresh_memory();
                    s.available_memory()
                })
                .unwrap_or(0),
            );
        }
        let sys_us = start.elapsed().as_secs_f64() * 1e6 / f64::from(N);
        println!(
            "read(): {read_us:.2} µs, read_rss(): {rss_us:.2} µs, sysinfo refresh_memory(): {sys_us:.2} µs ({sink})"
        );
    }
}
