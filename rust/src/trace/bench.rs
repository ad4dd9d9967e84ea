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
    let attribution = Attribution { stacks: &snapshot.stacks, rule: &rule, namer: &namer };
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
    let bytes = std::fs::read(&path).expect("readable");
    let (started, cpu) = (Instant::now(), cpu_time());
    let snapshot = Snapshot::from_pickle(&bytes).expect("a snapshot");
    let (parsed, parsed_cpu) = (started.elapsed(), cpu_time() - cpu);
    let events: usize = snapshot.device_traces.iter().map(Vec::len).sum();
    let seconds_per_gib = parsed_cpu.as_secs_f64() * (1u64 << 30) as f64 / bytes.len() as f64;
    println!(
        "{} MiB, {events} events, {} stacks: parsed in {parsed:?} ({parsed_cpu:?} CPU, {seconds_per_gib:.1} s of CPU per GiB)",
        bytes.len() >> 20,
        snapshot.stacks.count()
    );
    let started = Instant::now();
    let replay = replay(&snapshot, 0, None);
    println!("replayed in {:?}, peak {}", started.elapsed(), replay.peak.bytes);
    assert!(seconds_per_gib <= 10.0, "{seconds_per_gib:.1} s of CPU per GiB");
}
