//! The engine's speed, on large synthetic traces: `cargo test --release trace::bench -- --ignored
//! --nocapture`. Targets: a million events replayed in 0.5 s; a 1 GiB snapshot parsed in 10 s
//! (`GPUEXP_TRACE_PICKLE=path`; `python3 testdata/make_large.py EVENTS PATH` writes one).

use std::time::{Duration, Instant};

/// This thread's CPU time: the machine the bench runs on may be shared, and the targets are
/// about this code's work, not its neighbours'.
fn cpu_time() -> Duration {
    let mut now = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec, which `now` is.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut now) };
    Duration::new(now.tv_sec as u64, now.tv_nsec as u32)
}

use super::tests::Program;
use super::*;

/// The process's peak resident memory so far, in MiB (Linux's VmHWM).
fn peak_rss_mib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let line = status.lines().find(|line| line.starts_with("VmHWM:")).unwrap_or("");
    line.split_whitespace().nth(1).and_then(|kib| kib.parse::<u64>().ok()).unwrap_or(0) >> 10
}

/// A fingerprint of everything a snapshot was read into (events, segments, every stack's frames
/// in full), so two versions of the reader can be shown to read a file the same.
fn digest(snapshot: &AllocationHistory) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    for trace in &snapshot.device_traces {
        trace.len().hash(&mut hasher);
        for e in trace {
            (e.action, e.addr, e.size, e.stream, e.time_us, e.stack, e.device_free).hash(&mut hasher);
            e.annotation.map(|id| snapshot.stacks.string(id)).hash(&mut hasher);
        }
    }
    format!("{:?}", snapshot.segments).hash(&mut hasher);
    for stack in 0..snapshot.stacks.count() as StackId {
        for frame in snapshot.stacks.frames(stack) {
            (frame.filename, frame.line, frame.name).hash(&mut hasher);
        }
        u32::MAX.hash(&mut hasher);
    }
    hasher.finish()
}

#[test]
#[ignore = "a bench: run with --release -- --ignored"]
fn replaying_a_million_events_takes_under_half_a_second() {
    let mut p = Program::new();
    p.keep_sites = false;
    let lines: Vec<StackId> = (1..=50).map(|line| p.line(line)).collect();
    let mut held = std::collections::VecDeque::new();
    let mut i = 0u64;
    while p.events.len() < 1_000_000 {
        held.push_back(p.alloc(512 * (1 + i % 97), lines[(i % 50) as usize], "x"));
        if held.len() > 2000 {
            p.free(held.pop_front().expect("held"));
        }
        i += 1;
    }
    let (snapshot, truth, _) = p.snapshot(0);
    let (started, cpu) = (Instant::now(), cpu_time());
    let replay = replay(&snapshot, 0, None);
    let (replayed, replayed_cpu) = (started.elapsed(), cpu_time() - cpu);
    let (rule, namer) = (SiteRule::default(), PlainNamer::default());
    let attribution = Attribution::new(&snapshot.stacks, &rule, &namer);
    let started = Instant::now();
    let sites = peak_sites(&replay, &attribution, TOP_SITES);
    let timeline = timeline(&replay, &attribution, TOP_SITES);
    let reported = started.elapsed();
    println!(
        "{} events: replay {replayed:?} ({replayed_cpu:?} CPU), peak sites and timeline {reported:?}",
        snapshot.device_traces[0].len()
    );
    assert_eq!(replay.peak.bytes, *truth.iter().max().expect("events"));
    assert_eq!(sites.table.total, replay.peak.bytes);
    assert!(timeline.x.len() <= MAX_POINTS + 1);
    assert!(replayed_cpu.as_secs_f64() <= 0.5, "replay took {replayed_cpu:?} of CPU");
}

#[test]
#[ignore = "a bench: run with --release -- --ignored, GPUEXP_TRACE_PICKLE=path"]
fn parsing_a_large_snapshot_is_fast() {
    let Ok(path) = std::env::var("GPUEXP_TRACE_PICKLE") else {
        println!("set GPUEXP_TRACE_PICKLE to a snapshot (python3 testdata/make_large.py EVENTS PATH writes one)");
        return;
    };
    let (began, cpu) = (Instant::now(), cpu_time());
    let bytes = std::fs::read(&path).expect("readable");
    let read_cpu = cpu_time() - cpu;
    let (started, cpu) = (Instant::now(), cpu_time());
    let snapshot = AllocationHistory::from_pickle(&bytes).expect("a snapshot");
    let (parsed, parsed_cpu) = (started.elapsed(), cpu_time() - cpu);
    let events: usize = snapshot.device_traces.iter().map(Vec::len).sum();
    let seconds_per_gib = parsed_cpu.as_secs_f64() * (1u64 << 30) as f64 / bytes.len() as f64;
    println!(
        "{} MiB, {events} events, {} stacks: parsed in {parsed:?} ({parsed_cpu:?} CPU, {seconds_per_gib:.1} s of CPU per GiB), \
         peak RSS {} MiB with the file read in",
        bytes.len() >> 20,
        snapshot.stacks.count(),
        peak_rss_mib()
    );
    // What load_snapshot does next: every device replayed, its peak's sites, its timeline.
    let (rule, namer) = (SiteRule::default(), PlainNamer::default());
    let attribution = Attribution::new(&snapshot.stacks, &rule, &namer);
    let devices: Vec<u32> = snapshot.devices().into_iter().map(|d| d as u32).collect();
    let cpu = cpu_time();
    let traces = scope_traces(&snapshot, &devices, None, i64::MIN, &attribution);
    let analysed_cpu = cpu_time() - cpu;
    let peaks: Vec<u64> = traces.iter().map(|trace| trace.peak.table.total).collect();
    println!(
        "reading the file {read_cpu:?} CPU, replaying and attributing {analysed_cpu:?} CPU: load_snapshot's work {:?} \
         CPU in all ({:?} since the read began); peak RSS {} MiB; peaks {peaks:?}, digest {:016x}, analysis {:016x}",
        read_cpu + parsed_cpu + analysed_cpu,
        began.elapsed(),
        peak_rss_mib(),
        digest(&snapshot),
        {
            use std::hash::{Hash, Hasher};
            let mut hasher = std::collections::hash_map::DefaultHasher::new();
            format!("{traces:?}").hash(&mut hasher);
            hasher.finish()
        }
    );
    assert!(seconds_per_gib <= 10.0, "{seconds_per_gib:.1} s of CPU per GiB");
}
