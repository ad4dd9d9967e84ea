//! AllocationHistory files written to hurt what reads them whole: addresses chosen to collide, impossible
//! sizes, a load and its analysis stopped half-way, compressed and empty files (the pickle reader's own bombs are
//! `hostile_tests`).

use std::time::{Duration, Instant};

use super::*;
use crate::error::Error;

/// A pickle (protocol 2) of plain data, written as Python's pickler writes it (lists and
/// dicts filled in batches of 1000), without memo.
enum Py {
    Int(i128),
    Str(&'static str),
    List(Vec<Py>),
    Dict(Vec<(&'static str, Py)>),
}

fn pickled(value: &Py) -> Vec<u8> {
    let mut out = vec![0x80, 2];
    write(value, &mut out);
    out.push(b'.');
    out
}

fn write(value: &Py, out: &mut Vec<u8>) {
    match value {
        Py::Int(n) if i32::try_from(*n).is_ok() => {
            out.push(b'J');
            out.extend((*n as i32).to_le_bytes());
        }
        Py::Int(n) => {
            // LONG1: the shortest two's complement, little-endian.
            let bytes = n.to_le_bytes();
            let mut length = 16;
            while length > 1 {
                let (last, before) = (bytes[length - 1], bytes[length - 2]);
                if (last == 0 && before & 0x80 == 0) || (last == 0xff && before & 0x80 != 0) {
                    length -= 1;
                } else {
                    break;
                }
            }
            out.extend([0x8a, length as u8]);
            out.extend(&bytes[..length]);
        }
        Py::Str(text) => {
            out.push(b'X');
            out.extend((text.len() as u32).to_le_bytes());
            out.extend(text.as_bytes());
        }
        Py::List(items) => {
            out.push(b']');
            for batch in items.chunks(1000) {
                out.push(b'(');
                batch.iter().for_each(|item| write(item, out));
                out.push(b'e');
            }
        }
        Py::Dict(entries) => {
            out.push(b'}');
            out.push(b'(');
            for (key, value) in entries {
                write(&Py::Str(key), out);
                write(value, out);
            }
            out.push(b'u');
        }
    }
}

fn event(action: &'static str, addr: i128, size: i128) -> Py {
    Py::Dict(vec![
        ("action", Py::Str(action)),
        ("addr", Py::Int(addr)),
        ("size", Py::Int(size)),
        ("stream", Py::Int(0)),
        ("time_us", Py::Int(0)),
        ("frames", Py::List(Vec::new())),
    ])
}

fn snapshot_of(events: Vec<Py>, segments: Vec<Py>) -> Vec<u8> {
    pickled(&Py::Dict(vec![("segments", Py::List(segments)), ("device_traces", Py::List(vec![Py::List(events)]))]))
}

fn refused(bytes: &[u8]) -> String {
    match AllocationHistory::from_pickle(bytes) {
        Err(Error::InvalidArgument(message)) => message,
        other => panic!("not refused: {other:?}"),
    }
}

/// The replay of `addresses` each allocated, then each freed; the fastest of three.
fn replay_time(addresses: &[u64]) -> Duration {
    let event = |action, addr| Event {
        action,
        addr,
        size: 512,
        stream: 0,
        time_us: 0,
        stack: 0,
        device_free: 0,
        annotation: None,
    };
    let mut events: Vec<Event> = addresses.iter().map(|&a| event(Action::Alloc, a)).collect();
    events.extend(addresses.iter().map(|&a| event(Action::FreeRequested, a)));
    let snapshot = AllocationHistory { device_traces: vec![events], ..AllocationHistory::default() };
    (0..3)
        .map(|_| {
            let started = Instant::now();
            let replayed = replay(&snapshot, 0, None);
            assert_eq!(replayed.peak.bytes, 512 * addresses.len() as u64);
            started.elapsed()
        })
        .min()
        .expect("three runs")
}

#[test]
fn addresses_chosen_to_collide_replay_as_fast_as_random_ones() {
    const N: u64 = 20_000;
    // What collided under the unseeded multiply-rotate hasher the replay used: addresses whose
    // hashes, rotl(addr * K, 29), differ only in bits 40 and up, so every one fell in the same
    // bucket with the same tag (100k such events took 8.3 s, 60 times random addresses).
    const K: u64 = 0x9e37_79b9_7f4a_7c15;
    let inverse = (0..6).fold(K, |x, _| x.wrapping_mul(2u64.wrapping_sub(K.wrapping_mul(x))));
    assert_eq!(K.wrapping_mul(inverse), 1);
    let colliding: Vec<u64> = (1..=N).map(|i| (i << 40).rotate_right(29).wrapping_mul(inverse)).collect();
    assert!(colliding.iter().all(|a| a.wrapping_mul(K).rotate_left(29).trailing_zeros() >= 40));
    let mut state = 0x2545_f491_4f6c_dd1d_u64;
    let random: Vec<u64> = (0..N)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state & !511
        })
        .collect();
    let (chosen, spread) = (replay_time(&colliding), replay_time(&random));
    // Quadratic probing would be hundreds of times slower; a busy machine is not 10 times.
    assert!(chosen <= spread * 10 + Duration::from_millis(50), "colliding {chosen:?} against random {spread:?}");
}

#[test]
fn impossible_sizes_are_refused_with_their_field_and_place() {
    let negative = refused(&snapshot_of(vec![event("alloc", 0x7f00_0000_0000, -1)], vec![]));
    assert!(negative.contains("size -1 in event 0") && negative.contains("0x7f0000000000"), "{negative}");
    let past_64_bits = refused(&snapshot_of(vec![event("alloc", 4096, (1 << 64) - 1)], vec![]));
    assert!(past_64_bits.contains("size a number past 64 bits in event 0"), "{past_64_bits}");
    let petabytes = 1i128 << 52;
    let block = Py::Dict(vec![
        ("address", Py::Int(8192)),
        ("size", Py::Int(petabytes)),
        ("requested_size", Py::Int(512)),
        ("state", Py::Str("active_allocated")),
    ]);
    let segment = Py::Dict(vec![
        ("device", Py::Int(0)),
        ("address", Py::Int(8192)),
        ("total_size", Py::Int(1 << 21)),
        ("blocks", Py::List(vec![block])),
    ]);
    let in_a_block = refused(&snapshot_of(vec![], vec![segment]));
    assert!(
        in_a_block.contains("size 4503599627370496 in the block at address 0x2000 of the segment at address 0x2000"),
        "{in_a_block}"
    );
    assert!(in_a_block.contains("1.00 PiB"), "{in_a_block}");
    // A PiB each is possible; four thousand of them alive at once is not a device's peak.
    let many: Vec<Py> = (0..4096).map(|i| event("alloc", (i + 1) << 40, 1 << 50)).collect();
    let snapshot = AllocationHistory::from_pickle(&snapshot_of(many, vec![])).expect("each size is possible");
    let (rule, namer) = (SiteRule::default(), PlainNamer::default());
    let traces = scope_traces(&snapshot, &[0], None, i64::MIN, &Attribution::new(&snapshot.stacks, &rule, &namer));
    let peak = file::refuse_impossible_peaks(&traces).unwrap_err().to_string();
    assert!(peak.contains("a peak of 4.00 EiB on GPU 0") || peak.contains("on GPU 0, more than any device"), "{peak}");
}

#[test]
fn a_load_stops_when_asked_and_says_it_was_interrupted() {
    let events: Vec<Py> = (0..50_000).map(|i| event("alloc", (i + 1) * 512, 512)).collect();
    let bytes = snapshot_of(events, vec![]);
    let mut asked = 0;
    let whole = AllocationHistory::from_pickle_checked(&bytes, &mut || {
        asked += 1;
        Ok(())
    });
    assert_eq!(whole.expect("read").device_traces[0].len(), 50_000);
    assert!(asked >= 4, "asked {asked} times over {} bytes", bytes.len());
    let mut left = 2;
    let stopped = AllocationHistory::from_pickle_checked(&bytes, &mut || {
        left -= 1;
        if left == 0 {
            Err(Error::Interrupted)
        } else {
            Ok(())
        }
    });
    assert_eq!(stopped.err(), Some(Error::Interrupted));
}

#[test]
fn an_analysis_stops_at_any_of_its_asks_and_says_it_was_interrupted() {
    // Blocks alive at the peak and at the end, and an OOM: every long loop of the analysis.
    let mut events: Vec<Py> = (0..20_000).map(|i| event("alloc", (i + 1) * 512, 512)).collect();
    events.push(event("oom", 1 << 40, 1 << 40));
    let snapshot = AllocationHistory::from_pickle(&snapshot_of(events, vec![])).expect("a snapshot");
    let (rule, namer) = (SiteRule::default(), PlainNamer::default());
    let attribution = Attribution::new(&snapshot.stacks, &rule, &namer);
    let mut asked = 0;
    let whole = scope_traces_checked(&snapshot, &[0], None, i64::MIN, &attribution, &mut || {
        asked += 1;
        Ok(())
    });
    assert_eq!(whole.expect("never stopped"), scope_traces(&snapshot, &[0], None, i64::MIN, &attribution));
    assert!(asked >= 10, "asked {asked} times: a few times in each long loop");
    for stop_at in 1..=asked {
        let mut left = stop_at;
        let stopped = scope_traces_checked(&snapshot, &[0], None, i64::MIN, &attribution, &mut || {
            left -= 1;
            if left == 0 {
                Err(Error::Interrupted)
            } else {
                Ok(())
            }
        });
        assert_eq!(stopped.err(), Some(Error::Interrupted), "stopped at ask {stop_at} of {asked}");
    }
}

#[test]
fn compressed_special_and_empty_files_are_told_apart() {
    let directory = std::env::temp_dir().join(format!("gpuexp-hostile-{}", std::process::id()));
    std::fs::create_dir_all(&directory).unwrap();
    let gzipped = directory.join("snapshot.pickle.gz");
    std::fs::write(&gzipped, [0x1f, 0x8b, 8, 0, 0, 0, 0, 0]).unwrap();
    let error = file::read(&gzipped, &mut || Ok(())).unwrap_err().to_string();
    assert!(error.contains("gzip-compressed") && error.contains("gunzip -k"), "{error}");
    let fifo = directory.join("fifo.pickle");
    let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let error = file::read(&fifo, &mut || Ok(())).unwrap_err().to_string();
    assert!(error.contains("a FIFO") && error.contains("load_snapshot reads a snapshot file"), "{error}");
    let empty = directory.join("empty.pickle");
    std::fs::write(&empty, pickled(&Py::Dict(vec![]))).unwrap();
    let (_, snapshot) = file::read(&empty, &mut || Ok(())).unwrap();
    assert!(snapshot.devices().is_empty(), "nothing to show: the bindings say so (file::NO_HISTORY)");
    std::fs::remove_dir_all(directory).unwrap();
}
