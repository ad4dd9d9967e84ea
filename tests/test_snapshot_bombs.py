"""Pickles written to hurt the snapshot reader, read by the real `gpuexp.load_snapshot` in a child
process with a memory limit and a timeout: each gives a clear error (or an empty trace), where
before one killed the process (a 64 GiB memo, 22 GB of copied events, a stack overflow)."""

import os
import pickle
import signal
import struct
import subprocess
import sys
import textwrap
import time

import pytest

# The child's address space: the interpreter and gpuexp take a few hundred MB of it.
MEMORY_LIMIT = 2 << 30
TIMEOUT_S = 120


def text(s):
    data = s.encode()
    return b"X" + struct.pack("<I", len(data)) + data


def refs(index, times):
    """`times` BINGETs of memo entry `index` appended to the list on the stack, in batches."""
    out = b""
    for start in range(0, times, 1000):
        out += b"(" + b"h" + bytes([index]) + (b"h" + bytes([index])) * (min(1000, times - start) - 1) + b"e"
    return out


def nested_lists(depth):
    return b"(" * depth + b"N" + b"l" * depth


EVENT = b"}q\x00(" + text("action") + text("alloc") + text("addr") + b"K\x01" + text("size") + b"K\x01u"
BLOCK = b"}q\x00(" + text("address") + b"K\x01" + text("size") + b"K\x02" + text("state") + \
    text("active_allocated") + b"u"

BOMBS = {
    # An empty dict, then LONG_BINPUT 4294967294: a memo sized to the index is 64 GiB.
    "memo_index": b"\x80\x02}r\xfe\xff\xff\xff.",
    # 20,000 references to one list of 20,000 references to one event: 80 KB, 22 GB of events.
    "event_references": b"\x80\x02}(" + text("device_traces") + EVENT + b"0]q\x01" + refs(0, 20_000) +
    b"0]" + refs(1, 20_000) + b"u.",
    # The same with segments and their blocks.
    "block_references": b"\x80\x02}(" + text("segments") + BLOCK + b"0}q\x01(" + text("device") + b"K\x00" +
    text("blocks") + b"]" + refs(0, 20_000) + b"u0]" + refs(1, 20_000) + b"u.",
    # A million tuples, each holding the last; a million lists; a million lists under segments.
    "nested_tuples": b"\x80\x02N" + b"\x85" * 1_000_000 + b".",
    "nested_lists": b"\x80\x02" + nested_lists(1_000_000) + b".",
    "nested_segments": b"\x80\x02}(" + text("segments") + nested_lists(1_000_000) + b"u.",
}

CHILD = textwrap.dedent("""\
    import resource, sys
    resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
    import gpuexp
    try:
        trace = gpuexp.load_snapshot(sys.argv[1])
    except Exception as error:
        print(f"refused: {{type(error).__name__}}: {{error}}")
    else:
        print(f"read: {{len(trace.to_dict())}} devices")
    """)


def load_in_child(path):
    """load_snapshot(path) in a fresh interpreter limited to MEMORY_LIMIT of address space."""
    child = CHILD.format(limit=MEMORY_LIMIT)
    run = subprocess.run([sys.executable, "-c", child, str(path)], capture_output=True, text=True,
                         timeout=TIMEOUT_S, env=dict(os.environ))
    assert run.returncode == 0, f"the child died ({run.returncode}): {run.stderr[-2000:]}"
    return run.stdout.strip()


@pytest.mark.parametrize("bomb", ["event_references", "block_references"])
def test_references_to_references_are_refused_with_a_clear_error(tmp_path, bomb):
    path = tmp_path / f"{bomb}.pickle"
    path.write_bytes(BOMBS[bomb])
    assert path.stat().st_size < 100_000
    said = load_in_child(path)
    assert said.startswith("refused: ValueError: not a torch memory snapshot"), said
    assert "no snapshot torch writes" in said, said


@pytest.mark.parametrize("bomb", ["memo_index", "nested_tuples", "nested_lists", "nested_segments"])
def test_a_far_memo_index_and_deep_nesting_neither_kill_nor_exhaust_the_process(tmp_path, bomb):
    path = tmp_path / f"{bomb}.pickle"
    path.write_bytes(BOMBS[bomb])
    said = load_in_child(path)
    # A clear error that says what the file is not, or what little it holds (an empty segment
    # under "segments"), never a dead process.
    assert said.startswith(("refused: ValueError: not a torch memory snapshot", "read: ")), said


def test_the_limit_leaves_room_for_a_real_load(tmp_path):
    """The child can read a real snapshot under the same limit, so the refusals above are the
    reader's, not the limit's."""
    fixture = os.path.join(os.path.dirname(__file__), "..", "rust", "src", "trace", "testdata",
                           "snapshot_shared_frames_p4.pickle")
    assert load_in_child(fixture) == "read: 2 devices"


def event(addr, frames, **more):
    return {"action": "alloc", "addr": addr, "size": 512, "stream": 0, "time_us": 0, "frames": frames, **more}


def frame(filename, line, name="f"):
    return {"filename": filename, "line": line, "name": name}


def sharing(trace):
    """A snapshot of `trace`, pickled as torch's are: an object referred to twice is written
    once and referred back to (pickle's memo), so each file below is small for what it shares."""
    return pickle.dumps({"segments": [], "device_traces": [trace]}, protocol=4)


def one_stack_sharing_a_filename(tmp_path):
    """One 1 MiB filename shared by the 1,000 frames of one stack (1.1 MB)."""
    filename = "/home/u/" + "x" * (1 << 20)
    return sharing([event(1 << 40, [frame(filename, line) for line in range(1000)])])


def frame_dicts_sharing_a_name(tmp_path):
    """A 4 MiB string behind 4,000 frame dicts, 40 stacks of 100 (4.4 MB)."""
    name = "n" * (4 << 20)
    return sharing([event((1 << 40) + 512 * e, [frame("/home/u/train.py", 100 * e + i, name) for i in range(100)])
                    for e in range(40)])


def events_sharing_a_long_stack(tmp_path):
    """20,000 events sharing one list of 20,000 frames (2.1 MB)."""
    frames = [frame("/home/u/train.py", line) for line in range(20_000)]
    return sharing([event((1 << 40) + 512 * i, frames) for i in range(20_000)])


def events_sharing_metadata(tmp_path):
    """One 4 MiB user_metadata shared by 40,000 events (8.9 MB)."""
    metadata = "m" * (4 << 20)
    return sharing([event((1 << 40) + 512 * i, [], user_metadata=metadata) for i in range(40_000)])


def events_sharing_a_huge_filename(tmp_path):
    """A 96 MiB filename shared by 2,000 one-frame events, each its own line (100 MB): each
    site named and each stack shown from the clipped name, never the 96 MiB one."""
    filename = "/home/u/" + "x" * (96 << 20)
    return sharing([event((1 << 40) + 512 * i, [frame(filename, i)]) for i in range(2000)])


def sparse_8_gib(tmp_path):
    """An 8 GiB sparse file (no disk used): zeros, no pickle."""
    return None


SHARING = [one_stack_sharing_a_filename, frame_dicts_sharing_a_name, events_sharing_a_long_stack,
           events_sharing_metadata, events_sharing_a_huge_filename, sparse_8_gib]

# Loads the file, shows it as text and as a dict, and says how long that took; in a loop with
# `--forever` until Ctrl-C, which it answers with the time it was raised.
SHARING_CHILD = textwrap.dedent("""\
    import resource, sys, time
    resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
    import gpuexp
    def load():
        try:
            trace = gpuexp.load_snapshot(sys.argv[1])
            return f"read: {{len(str(trace))}} characters, {{len(trace.to_dict())}} devices"
        except ValueError as error:
            return f"refused: {{error}}"
    if sys.argv[2] == "once":
        started = time.monotonic()
        said = load()
        print(f"{{time.monotonic() - started:.2f}} s {{said[:300]}}")
    else:
        print("loading", flush=True)
        try:
            while True:
                load()
        except KeyboardInterrupt:
            print("interrupted at", time.time())
    """)

# What each may take in the child, a debug build on a shared machine included.
SHARING_TIMEOUT_S = 60


def sharing_file(tmp_path, make):
    path = tmp_path / f"{make.__name__}.pickle"
    made = make(tmp_path)
    if made is None:
        with open(path, "wb") as out:
            out.truncate(8 << 30)
    else:
        path.write_bytes(made)
    return path


@pytest.mark.parametrize("make", SHARING, ids=[make.__name__ for make in SHARING])
def test_what_a_file_shares_is_read_once_within_memory_and_time(tmp_path, make):
    path = sharing_file(tmp_path, make)
    child = SHARING_CHILD.format(limit=MEMORY_LIMIT)
    run = subprocess.run([sys.executable, "-c", child, str(path), "once"], capture_output=True, text=True,
                         timeout=SHARING_TIMEOUT_S, env=dict(os.environ))
    assert run.returncode == 0, f"the child died ({run.returncode}): {run.stderr[-2000:]}"
    seconds, said = run.stdout.split(" s ", 1)
    if make is sparse_8_gib:
        assert said.startswith("refused: not a torch memory snapshot (unknown pickle opcode 0x00"), said
        assert float(seconds) < 1, "refused from its start, not read whole"
    else:
        assert said.startswith("read: "), said
        assert float(seconds) < SHARING_TIMEOUT_S / 2, said


@pytest.mark.parametrize("make", SHARING, ids=[make.__name__ for make in SHARING])
def test_ctrl_c_is_honoured_within_half_a_second_on_each_sharing_file(tmp_path, make):
    """SIGINT from outside, as the stop button sends it, lands wherever the load is: reading,
    parsing, analysing or showing the file."""
    path = sharing_file(tmp_path, make)
    child = SHARING_CHILD.format(limit=MEMORY_LIMIT)
    child = subprocess.Popen([sys.executable, "-c", child, str(path), "forever"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "loading\n"
        time.sleep(1.5)
        sent = time.time()
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=SHARING_TIMEOUT_S)
    finally:
        child.kill()
    assert out.startswith("interrupted at"), out + err
    assert float(out.split()[-1]) - sent < 0.5, out
