"""Pickles written to hurt the snapshot reader, read by the real `gpuexp.load_snapshot` in a child
process with a memory limit and a timeout: each gives a clear error (or an empty trace), where
before one killed the process (a 64 GiB memo, 22 GB of copied events, a stack overflow)."""

import os
import struct
import subprocess
import sys
import textwrap

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
