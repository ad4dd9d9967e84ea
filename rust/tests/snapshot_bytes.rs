//! Property tests of the snapshot reader on the stable toolchain (`make fuzz` runs libFuzzer on
//! the same reader for longer): arbitrary bytes, and real snapshots with bytes changed, put in
//! or cut out, read to a snapshot or a clean error, never a panic, in memory that the file's
//! size bounds. Its own test binary, so that its allocator can count what the reader holds.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use gpuexp_core::trace::AllocationHistory;
use proptest::prelude::*;

// The fuzz target's body, so that what is fuzzed on nightly is what these tests read here.
include!("../fuzz/fuzz_targets/read_any_bytes.rs");

/// Counts this thread's live and peak heap bytes (the test harness runs tests on threads).
struct Counting;

thread_local! {
    static LIVE: Cell<usize> = const { Cell::new(0) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
}

// SAFETY: every call is passed to the system allocator as it came; the counters are
// const-initialised thread locals, which allocate nothing.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            grew(layout.size() as isize);
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) };
        grew(-(layout.size() as isize));
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let new = unsafe { System.realloc(ptr, layout, new_size) };
        if !new.is_null() {
            grew(new_size as isize - layout.size() as isize);
        }
        new
    }
}

fn grew(bytes: isize) {
    let _ = LIVE.try_with(|live| {
        let now = live.get().saturating_add_signed(bytes);
        live.set(now);
        let _ = PEAK.try_with(|peak| peak.set(peak.get().max(now)));
    });
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// What reading `bytes` held at most, beyond what was held before.
fn peak_while_reading(bytes: &[u8]) -> usize {
    let before = LIVE.with(Cell::get);
    PEAK.with(|peak| peak.set(before));
    read_any_bytes(bytes);
    PEAK.with(Cell::get) - before
}

/// The reader's stated bound (docs/robustness.md, "Memory is bounded by the file's size"): the
/// parse's peak heap is at most 8 times the file's size and 256 MiB.
fn bound(len: usize) -> usize {
    8 * len + (256 << 20)
}

const FIXTURES: [&[u8]; 5] = [
    include_bytes!("../src/trace/testdata/snapshot_p2.pickle"),
    include_bytes!("../src/trace/testdata/snapshot_p4.pickle"),
    include_bytes!("../src/trace/testdata/snapshot_p5.pickle"),
    include_bytes!("../src/trace/testdata/snapshot_shared_frames_p0.pickle"),
    include_bytes!("../src/trace/testdata/snapshot_shared_frames_p4.pickle"),
];

/// Marks, containers, memo puts and gets, appends and sets, DUP, small ints, None, strings.
const OPCODES: &[u8] = b"(((}}]])hhhqqq\x94eeuuasss2NK\x01K\x00\x85\x86tld0";

/// One change to a file: a byte set, bytes put in (a run of one, as a length or index would
/// be), or a range cut out.
#[derive(Clone, Debug)]
enum Change {
    Set(usize, u8),
    Insert(usize, u8, usize),
    Cut(usize, usize),
}

fn change() -> impl Strategy<Value = Change> {
    prop_oneof![
        4 => (any::<usize>(), any::<u8>()).prop_map(|(at, byte)| Change::Set(at, byte)),
        1 => (any::<usize>(), any::<u8>(), 1usize..9).prop_map(|(at, byte, n)| Change::Insert(at, byte, n)),
        1 => (any::<usize>(), 1usize..64).prop_map(|(at, n)| Change::Cut(at, n)),
    ]
}

fn changed(file: &[u8], changes: &[Change]) -> Vec<u8> {
    let mut bytes = file.to_vec();
    for change in changes {
        let len = bytes.len().max(1);
        match *change {
            Change::Set(at, byte) if !bytes.is_empty() => bytes[at % len] = byte,
            Change::Insert(at, byte, n) => {
                let at = at % (bytes.len() + 1);
                bytes.splice(at..at, std::iter::repeat_n(byte, n));
            }
            Change::Cut(at, n) if !bytes.is_empty() => {
                let at = at % len;
                bytes.drain(at..(at + n).min(bytes.len()));
            }
            _ => {}
        }
    }
    bytes
}

// Some 20 s in all on 2 cores in a debug build (a mutated real snapshot reads in some 20 ms).
proptest! {
    #![proptest_config(ProptestConfig { cases: 1500, ..ProptestConfig::default() })]

    #[test]
    fn any_bytes_read_to_a_snapshot_or_an_error(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let peak = peak_while_reading(&bytes);
        prop_assert!(peak <= bound(bytes.len()), "{} bytes held {peak} bytes", bytes.len());
    }

    #[test]
    fn opcodes_after_a_pickle_header_read_to_a_snapshot_or_an_error(
        protocol in 2u8..6,
        body in proptest::collection::vec(any::<u8>(), 0..512),
    ) {
        // The low half of the bytes drawn picks among the opcodes that build and refer back
        // (random bytes seldom make a container), the high half is itself.
        let ops = |byte: u8| if byte < 0x80 { OPCODES[byte as usize % OPCODES.len()] } else { byte };
        let bytes: Vec<u8> = [0x80, protocol].into_iter().chain(body.into_iter().map(ops)).collect();
        let peak = peak_while_reading(&bytes);
        prop_assert!(peak <= bound(bytes.len()), "{} bytes held {peak} bytes", bytes.len());
    }

}

proptest! {
    #![proptest_config(ProptestConfig { cases: 600, ..ProptestConfig::default() })]

    #[test]
    fn real_snapshots_changed_read_to_a_snapshot_or_an_error(
        fixture in 0..FIXTURES.len(),
        changes in proptest::collection::vec(change(), 1..8),
    ) {
        let bytes = changed(FIXTURES[fixture], &changes);
        let peak = peak_while_reading(&bytes);
        prop_assert!(peak <= bound(bytes.len()), "{} bytes held {peak} bytes", bytes.len());
    }
}

#[test]
fn the_real_snapshots_read_whole_within_the_bound() {
    for file in FIXTURES {
        AllocationHistory::from_pickle(file).expect("a real snapshot reads");
        assert!(peak_while_reading(file) <= bound(file.len()));
    }
}

/// Pickle opcodes (protocol 4) for the sharing files below: a string, an int, a memo put and
/// get (what makes a file share one object among many places).
fn text(s: &str) -> Vec<u8> {
    [&[b'X'][..], &(s.len() as u32).to_le_bytes(), s.as_bytes()].concat()
}

fn int(n: u32) -> Vec<u8> {
    [&[b'J'][..], &n.to_le_bytes()].concat()
}

fn put(index: u32) -> Vec<u8> {
    [&[b'r'][..], &index.to_le_bytes()].concat()
}

fn get(index: u32) -> Vec<u8> {
    [&[b'j'][..], &index.to_le_bytes()].concat()
}

/// A frame dict whose filename and name are the pickled values given (a string, or a get).
fn frame(filename: &[u8], line: u32, name: &[u8]) -> Vec<u8> {
    [b"}(", &text("filename")[..], filename, &text("line"), &int(line), &text("name"), name, b"u"].concat()
}

/// An event dict with its frames (a list, or a get) and more entries.
fn event(addr: u32, frames: &[u8], more: &[u8]) -> Vec<u8> {
    let head = [text("action"), text("alloc"), text("addr"), int(addr), text("size"), int(512)].concat();
    [b"}(", &head[..], &text("frames"), frames, more, b"u"].concat()
}

/// `{"segments": [], "device_traces": [events]}`, pickled.
fn snapshot(events: &[Vec<u8>]) -> Vec<u8> {
    let events = [b"](", &events.concat()[..], b"e"].concat();
    [b"\x80\x04}(", &text("segments")[..], b"]", &text("device_traces"), b"](", &events, b"eu."].concat()
}

fn list(items: &[Vec<u8>]) -> Vec<u8> {
    [b"](", &items.concat()[..], b"e"].concat()
}

/// One 1 MiB filename shared by the 1,000 frames of one stack.
fn one_stack_sharing_a_filename() -> Vec<u8> {
    let filename = format!("/home/u/{}", "x".repeat(1 << 20));
    let (first, again) = ([text(&filename), put(0)].concat(), get(0));
    let frames: Vec<Vec<u8>> =
        (0..1000).map(|line| frame(if line == 0 { &first } else { &again }, line, &text("f"))).collect();
    snapshot(&[event(4096, &list(&frames), b"")])
}

/// A 4 MiB function name behind 4,000 frame dicts, 40 stacks of 100.
fn frame_dicts_sharing_a_name() -> Vec<u8> {
    let (first, again) = ([text(&"n".repeat(4 << 20)), put(0)].concat(), get(0));
    let events: Vec<Vec<u8>> = (0..40)
        .map(|e| {
            let frames: Vec<Vec<u8>> = (0..100)
                .map(|i| frame(&text("/home/u/train.py"), 100 * e + i, if e + i == 0 { &first } else { &again }))
                .collect();
            event(4096 + 512 * e, &list(&frames), b"")
        })
        .collect();
    snapshot(&events)
}

/// 5,000 events sharing one list of 5,000 frames.
fn events_sharing_a_frames_list() -> Vec<u8> {
    let frames: Vec<Vec<u8>> = (0..5000).map(|line| frame(&text("/home/u/train.py"), line, &text("f"))).collect();
    let first = [b"]".to_vec(), put(0), b"(".to_vec(), frames.concat(), b"e".to_vec()].concat();
    let again = get(0);
    let events: Vec<Vec<u8>> =
        (0..5000).map(|i| event(4096 + 512 * i, if i == 0 { &first } else { &again }, b"")).collect();
    snapshot(&events)
}

/// One 4 MiB user_metadata shared by 10,000 events.
fn events_sharing_metadata() -> Vec<u8> {
    let first = [text("user_metadata"), text(&"m".repeat(4 << 20)), put(0)].concat();
    let shared = [text("user_metadata"), get(0)].concat();
    let events: Vec<Vec<u8>> =
        (0..10_000).map(|i| event(4096 + 512 * i, &list(&[]), if i == 0 { &first } else { &shared })).collect();
    snapshot(&events)
}

#[test]
fn files_that_share_strings_frames_lists_and_metadata_read_within_the_stated_bound() {
    for (name, file, count, frames) in [
        ("one stack sharing a filename", one_stack_sharing_a_filename(), 1, 1000),
        ("frame dicts sharing a name", frame_dicts_sharing_a_name(), 40, 100),
        ("events sharing a frames list", events_sharing_a_frames_list(), 5000, 5000),
        ("events sharing metadata", events_sharing_metadata(), 10_000, 0),
    ] {
        let snapshot = AllocationHistory::from_pickle(&file).unwrap_or_else(|e| panic!("{name}: {e}"));
        let events = &snapshot.device_traces[0];
        assert_eq!(events.len(), count, "{name}: every event read");
        assert_eq!(snapshot.stacks.frames(events[count - 1].stack).count(), frames, "{name}: its frames read");
        let peak = peak_while_reading(&file);
        assert!(peak <= bound(file.len()), "{name}: {} bytes held {peak} bytes", file.len());
        // Shared, each string is held a few times at most, never once per place it is used.
        assert!(peak <= 8 * file.len() + (32 << 20), "{name}: {} bytes held {peak} bytes", file.len());
    }
}
