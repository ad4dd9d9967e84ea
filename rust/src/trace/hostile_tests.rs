//! The snapshot reader against files written to hurt it: each is read to an error or an empty
//! snapshot, in memory and time that the file's size bounds, and never runs anything.

use super::pickle::{self, Finish, Value};
use super::*;

/// Leaves every container as it is.
struct Plain;

impl Finish for Plain {
    fn finish(&mut self, item: Value, _read: &mut Vec<(Value, u32)>) -> Value {
        item
    }
}

/// A pickle opcode writer, enough to build the files below.
#[derive(Default)]
pub(super) struct Pickle(pub Vec<u8>);

impl Pickle {
    pub fn new() -> Pickle {
        Pickle(b"\x80\x02".to_vec())
    }

    pub fn op(&mut self, bytes: &[u8]) -> &mut Pickle {
        self.0.extend_from_slice(bytes);
        self
    }

    pub fn text(&mut self, text: &str) -> &mut Pickle {
        self.0.push(b'X');
        self.0.extend_from_slice(&(text.len() as u32).to_le_bytes());
        self.op(text.as_bytes())
    }

    pub fn put(&mut self, index: u8) -> &mut Pickle {
        self.op(&[b'q', index])
    }

    /// `times` references to memo entry `index`, appended to the list on the stack in
    /// batches, as Python's pickler appends.
    pub fn append_refs(&mut self, index: u8, times: usize) -> &mut Pickle {
        for batch in 0..times.div_ceil(999) {
            self.op(b"(");
            for _ in 0..999.min(times - batch * 999) {
                self.op(&[b'h', index]);
            }
            self.op(b"e");
        }
        self
    }

    pub fn end(&mut self) -> Vec<u8> {
        self.op(b".");
        std::mem::take(&mut self.0)
    }
}

fn refused(bytes: &[u8]) -> String {
    match AllocationHistory::from_pickle(bytes) {
        Ok(snapshot) => panic!(
            "read {} events and {} blocks from {} bytes",
            snapshot.device_traces.iter().map(Vec::len).sum::<usize>(),
            snapshot.segments.iter().map(|s| s.blocks.len()).sum::<usize>(),
            bytes.len()
        ),
        Err(error) => error.to_string(),
    }
}

#[test]
fn a_memo_index_the_file_chose_costs_one_entry_not_a_memo_that_long() {
    // An empty dict, then LONG_BINPUT 4294967294: a memo sized to the index is 64 GiB.
    let value = pickle::read(b"\x80\x02}r\xfe\xff\xff\xff.", &mut Plain).unwrap();
    assert!(matches!(value.root, Value::Dict(_)));
    let value = pickle::read(b"\x80\x02}r\xfe\xff\xff\xff0j\xfe\xff\xff\xff.", &mut Plain).unwrap();
    assert!(matches!(value.root, Value::Dict(_)), "read back from the far index");
    let error = pickle::read(b"\x80\x02}r\x05\x00\x00\x000j\x02\x00\x00\x00.", &mut Plain).map(|_| ()).unwrap_err();
    assert!(error.contains("never made"), "{error}");
    let snapshot = AllocationHistory::from_pickle(b"\x80\x02}r\xfe\xff\xff\xff.").unwrap();
    assert!(snapshot.device_traces.is_empty() && snapshot.segments.is_empty());
}

/// `{"action": "alloc", "addr": 1, "size": 1}` as memo entry 0.
fn event(p: &mut Pickle) -> &mut Pickle {
    p.op(b"}").put(0).op(b"(").text("action").text("alloc").text("addr").op(b"K\x01").text("size");
    p.op(b"K\x01u")
}

#[test]
fn references_to_references_are_refused_not_built_as_copies() {
    // device_traces: 2,000 references to one list of 2,000 references to one event. 8 KB of
    // file, 4 million events (224 MB) built; at 20,000 each, 80 KB and 22 GB.
    let mut p = Pickle::new();
    p.op(b"}(").text("device_traces");
    event(&mut p);
    p.op(b"0]").put(1).append_refs(0, 2000).op(b"0]").append_refs(1, 2000);
    let error = refused(&p.op(b"u").end());
    assert!(error.contains("not a torch memory snapshot") && error.contains("no snapshot torch writes"), "{error}");

    // segments: 2,000 references to one segment whose blocks are 2,000 references to a block.
    let mut p = Pickle::new();
    p.op(b"}(").text("segments").op(b"}").put(0).op(b"(").text("address").op(b"K\x01").text("size");
    p.op(b"K\x02u0}").put(1).op(b"(").text("device").op(b"K\x00").text("blocks").op(b"]");
    p.append_refs(0, 2000).op(b"u0]").append_refs(1, 2000);
    let error = refused(&p.op(b"u").end());
    assert!(error.contains("no snapshot torch writes"), "{error}");
}

#[test]
fn a_stack_referred_to_by_every_block_is_charged_each_time_it_is_read() {
    // A frames tuple of 5,000 frames that no block reads once for all (a tuple is not noted as
    // a list is), under 2,000 blocks: 10 million frame visits from 20 KB.
    let mut p = Pickle::new();
    p.op(b"}(").text("segments").op(b"]").put(9).op(b"(").op(b"}").put(0).op(b"(").text("filename");
    p.text("a.py").op(b"u0(");
    for _ in 0..5000 {
        p.op(b"h\x00");
    }
    p.op(b"t").put(1).op(b"0}").put(2).op(b"(").text("frames").op(b"h\x01u0}(").text("blocks").op(b"]");
    p.append_refs(2, 2000).op(b"ue");
    let error = refused(&p.op(b"u").end());
    assert!(error.contains("no snapshot torch writes"), "{error}");
}

#[test]
fn a_container_put_inside_itself_is_freed_with_the_rest() {
    // A list appended to itself, through the memo and through DUP: a cycle of references.
    for bytes in [&b"\x80\x02]q\x00h\x00a."[..], b"\x80\x02]2a.", b"\x80\x02}q\x00K\x01h\x00s."] {
        let pickled = pickle::read(bytes, &mut Plain).unwrap();
        let root = pickled.root.clone();
        assert_eq!(root.item_count(), 1, "it holds itself");
        drop(pickled);
        let count = match &root {
            Value::List(list) => std::rc::Rc::strong_count(list),
            Value::Dict(dict) => std::rc::Rc::strong_count(dict),
            _ => panic!("{root:?}"),
        };
        assert_eq!(count, 1, "only this test's reference is left: freed when it goes");
    }
}

#[test]
fn an_event_whose_frames_are_the_list_it_is_appended_to_reads() {
    // Found by libFuzzer: the event is read as it is appended, and its frames list is that
    // list, then borrowed for the append ("RefCell already mutably borrowed").
    let mut p = Pickle::new();
    p.op(b"}(").text("device_traces").op(b"]").put(1).op(b"]").put(0).op(b"}");
    p.text("action").text("alloc").op(b"s").text("frames").op(b"h\x00sa").op(b"a");
    let snapshot = AllocationHistory::from_pickle(&p.op(b"u").end()).unwrap();
    let events = &snapshot.device_traces[0];
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].action, Action::Alloc);
}

/// Nested `depth` deep: tuples, lists, dicts (each level a new container around the last).
fn nested(depth: usize) -> [Vec<u8>; 3] {
    let tuples = [&b"\x80\x02N"[..], &vec![0x85; depth], b"."].concat();
    let lists = [&b"\x80\x02"[..], &vec![b'('; depth], b"N", &vec![b'l'; depth], b"."].concat();
    let dicts = [&b"\x80\x02"[..], &b"(K\x01".repeat(depth), b"N", &vec![b'd'; depth], b"."].concat();
    [tuples, lists, dicts]
}

#[test]
fn containers_nested_a_million_deep_are_read_and_freed_without_recursion() {
    // The test thread's 2 MiB stack: a recursive drop overflowed it some 30,000 levels down.
    for (kind, bytes) in ["tuples", "lists", "dicts"].iter().zip(nested(1_000_000)) {
        let value = pickle::read(&bytes, &mut Plain).unwrap_or_else(|e| panic!("{kind}: {e}"));
        drop(value);
        match AllocationHistory::from_pickle(&bytes) {
            Ok(snapshot) => assert!(*kind == "dicts" && snapshot.device_traces.is_empty(), "{kind}"),
            Err(error) => assert!(error.to_string().contains("holds no dict"), "{kind}: {error}"),
        }
    }
    // Twice 300,000 deep under the keys (ten times what a recursion survived): two million
    // lists (72 bytes each) in a 4 MB file hold more than the budget allows, and are refused.
    let [_, lists, _] = nested(300_000);
    let mut p = Pickle::new();
    p.op(b"}(").text("segments").op(&lists[2..lists.len() - 1]);
    p.text("device_traces").op(&lists[2..lists.len() - 1]);
    let snapshot = AllocationHistory::from_pickle(&p.op(b"u").end()).unwrap();
    assert_eq!(snapshot.segments.len(), 1, "the one item of the outermost list");
    assert!(snapshot.device_traces.iter().all(Vec::is_empty));
}

#[test]
fn classes_and_calls_in_the_file_are_opaque_values_never_run() {
    // os.system("touch ...") as pickle writes it (GLOBAL, REDUCE), and its protocol 4 form
    // (STACK_GLOBAL), and INST, OBJ, BUILD, NEWOBJ: each an opaque value.
    let marker = std::env::temp_dir().join(format!("gpuexp-pickle-ran-{}", std::process::id()));
    let command = format!("touch {}", marker.display());
    let mut p = Pickle::new();
    p.op(b"}(").text("device_traces").op(b"cos\nsystem\n(").text(&command).op(b"tR");
    p.text("segments").text("os").text("system").op(b"\x93(").text(&command).op(b"tR");
    p.text("x").op(b"(").text(&command).op(b"ios\nsystem\n");
    p.text("y").op(b"cos\nsystem\n)\x81}b");
    let bytes = p.op(b"u").end();
    let value = pickle::read(&bytes, &mut Plain).unwrap();
    for key in ["device_traces", "segments", "x", "y"] {
        assert!(matches!(value.root.get(key), Some(Value::Opaque)), "{key}");
    }
    let snapshot = AllocationHistory::from_pickle(&bytes).unwrap();
    assert!(snapshot.device_traces.is_empty() && snapshot.segments.is_empty());
    assert!(!marker.exists(), "a call in the pickle ran");
}
