"""The Rust crate's layers, read from its sources (no build): the core knows no PyO3, its
top-level modules import each other without a circle and only downwards through the floors that
docs/ARCHITECTURE.md draws, and the bindings stay a thin share of the code."""

import re
from functools import cache
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "rust" / "src"
BINDINGS = SRC / "bindings"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
# Where the drawing of the floors in ARCHITECTURE.md starts its entries, after the floors' labels.
DRAWING_COLUMN = 18

# The core's floors as docs/ARCHITECTURE.md draws them ("The floors"), lowest first: a module may
# import its own floor's modules and lower floors' ones, never a higher floor's. A new module gets
# its floor here and in the drawing.
FLOORS = {
    # 0 the ground: units, tables, what an experiment varied, errors, per-process state, files
    "units": 0, "grid": 0, "params": 0, "error": 0, "uninspectable": 0, "locks": 0, "fork": 0,
    "files": 0,
    # 1 one reading
    "snapshot": 1, "recording_lease": 1,
    # 2 what a report quotes besides snapshots: the monitor's samples, training's position, the
    # names teardown deleted, a step's ledger (whose categories the trace sorts its sites by)
    "monitor": 2, "peak_sampler": 2, "training": 2, "teardown": 2, "estimate": 2,
    "estimate_books": 2, "cudnn_rnn": 2, "scalar_reads": 2,
    # 3, 4, 5: trace → report → explain
    "trace": 3, "recorder": 3, "torch_history": 3, "cell_history": 3,
    "report": 4,
    "explain": 5,
    # 6 experiments and the jobs run over them
    "scope": 6, "ranks": 6, "finder": 6, "holders_walk": 6, "step_state": 6, "estimate_run": 6,
    "stack_sampling": 6, "live_view": 6, "compare": 6, "status": 6,
    "watch": 6, "fit": 6, "host_tracing": 6, "kept_snapshots": 6,
    "oom_rescue": 6,
}  # fmt: skip


RAW_STRING = re.compile(r'(?<!\w)b?r(#*)"')
CHAR = re.compile(r"(?<!\w)b?'(\\u\{[0-9a-fA-F]+\}|\\.|[^\\'])'")


def code_of(text):
    """Rust source with comments removed and string and char literals emptied, so that braces,
    paths and words are only the code's."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            i = text.find("\n", i)
            i = n if i < 0 else i
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    out.append("\n" if text[i] == "\n" else "")
                    i += 1
        elif raw := RAW_STRING.match(text, i):
            end = text.find('"' + raw[1], raw.end())
            out.append('""' + "\n" * text.count("\n", i, end))
            i = end + 1 + len(raw[1])
        elif c == '"' or text.startswith('b"', i):
            i += 1 if c == '"' else 2
            start = i
            while text[i] != '"':
                i += 2 if text[i] == "\\" else 1
            out.append('""' + "\n" * text.count("\n", start, i))
            i += 1
        elif char := CHAR.match(text, i):
            out.append("' '")
            i = char.end()
        else:
            out.append(c)
            i += 1
    return "".join(out)


def after_block(code, brace):
    """Where the block that opens with the brace at `brace` ends, just after its closing brace."""
    depth = 0
    for end in range(brace, len(code)):
        depth += {"{": 1, "}": -1}.get(code[end], 0)
        if depth == 0:
            return end + 1
    raise ValueError("a block without its closing brace")


def cfg_test_spans(code):
    """Where `code`'s `#[cfg(test)]` items are, each a `mod tests;` line or a braced block."""
    spans, at = [], code.find("#[cfg(test)]")
    while at >= 0:
        brace, semicolon = code.find("{", at), code.find(";", at)
        if semicolon >= 0 and (brace < 0 or semicolon < brace):
            end = semicolon + 1
        else:
            end = after_block(code, brace)
        spans.append((at, end))
        at = code.find("#[cfg(test)]", end)
    return spans


def without_tests(code):
    """`code` without its `#[cfg(test)]` items, its lines kept in place."""
    for start, end in reversed(cfg_test_spans(code)):
        code = code[:start] + "\n" * code.count("\n", start, end) + code[end:]
    return code


def is_test_file(path):
    return path.name == "tests.rs" or path.name.endswith("_tests.rs")


def core_files():
    return [
        path
        for path in sorted(SRC.rglob("*.rs"))
        if BINDINGS not in path.parents and path.name != "lib.rs" and not is_test_file(path)
    ]


def top_module(path):
    return path.relative_to(SRC).parts[0].removesuffix(".rs")


def core_modules():
    """The crate's top-level modules, as lib.rs declares them (the bindings aside)."""
    declared = re.findall(r"^(?:pub )?mod (\w+);", code_of_file(SRC / "lib.rs"), re.M)
    return set(declared) - {"bindings"}


def imported_modules(code, modules):
    """The top-level modules that `code` names through `crate::`, in paths and in
    `use crate::{a, b::C}` groups alike."""
    found = set()
    for match in re.finditer(r"\bcrate\s*::\s*(\{|\w+)", code):
        if match[1] != "{":
            found.add(match[1])
            continue
        start = match.start(1)
        group, level, items, item = code[start + 1 : after_block(code, start) - 1], 0, [], ""
        for c in group:
            level += {"{": 1, "}": -1}.get(c, 0)
            if c == "," and level == 0:
                items.append(item)
                item = ""
            else:
                item += c
        items.append(item)
        found.update(m[1] for m in (re.match(r"\s*(\w+)", i) for i in items) if m)
    return found & modules


@cache
def code_of_file(path):
    return code_of(path.read_text(encoding="utf-8"))


@cache
def import_graph():
    modules = core_modules()
    graph = {module: set() for module in modules}
    for path in core_files():
        module = top_module(path)
        graph[module] |= imported_modules(without_tests(code_of_file(path)), modules)
    for module in graph:
        graph[module].discard(module)
    return graph


def test_the_sources_are_read_as_code():
    code = code_of('let a = "{ crate::x }"; // crate::y\nlet b = \'{\'; /* crate::z */ r#"}"#;\n')
    assert "crate" not in code and code.count("{") == code.count("}") == 0
    assert code.count("\n") == 2
    tested = "fn f() {}\n#[cfg(test)]\nmod tests;\n#[cfg(test)]\nmod inline {\n    fn g() { }\n}\n"
    assert without_tests(tested).strip() == "fn f() {}"
    modules = {"a", "b", "c", "d"}
    assert imported_modules("use crate::{a::{X, Y}, b};\nlet v = crate::c::f();", modules) == {"a", "b", "c"}


def test_the_graph_is_read():
    graph = import_graph()
    assert {"snapshot", "report", "teardown"} <= graph["scope"]
    assert "trace" in graph["report"]


def test_no_core_module_knows_the_bindings_or_pyo3():
    offenders = [
        path.relative_to(SRC)
        for path in SRC.rglob("*.rs")
        if BINDINGS not in path.parents
        and path.name != "lib.rs"
        and re.search(r"\b(bindings|pyo3)\b", code_of_file(path))
    ]
    assert offenders == [], f"core files that name the bindings or pyo3: {offenders}"
    # The crate root declares the bindings only for the wheel, so `cargo test` links no libpython.
    lib = code_of_file(SRC / "lib.rs")
    assert re.search(r'#\[cfg\(feature = ""\)\]\s*mod bindings;', lib), "lib.rs: mod bindings without its feature"


def test_the_core_modules_import_each_other_without_a_circle():
    try:
        TopologicalSorter(import_graph()).prepare()
    except CycleError as error:
        pytest.fail("import circle: " + " -> ".join(error.args[1]))


def drawn_floors():
    """Each module's floor in the drawing under ARCHITECTURE.md's "The floors": the floors are
    separated by rules, a floor's number leads its first line, and a module is placed where an
    entry (at a line's start or after a `·`) names its file or folder."""
    section = ARCHITECTURE.read_text(encoding="utf-8").split("## The floors", 1)[1]
    drawing = section.split("```", 2)[1]
    drawn = {}
    for floor in re.split(r"^ [─═].*$", drawing, flags=re.M):
        number = re.search(r"^ (\d+) ", floor.strip("\n"))
        if number:
            for line in floor.splitlines():
                for module in re.findall(r"(?:^|· )(\w+)(?:\.rs|/)(?= \(|$)", line[DRAWING_COLUMN:]):
                    drawn[module] = int(number[1])
    return drawn


def test_every_core_module_has_a_floor_and_a_place_in_the_architecture():
    modules = core_modules()
    assert modules == set(FLOORS), f"without a floor: {modules - set(FLOORS)}; gone: {set(FLOORS) - modules}"
    text = ARCHITECTURE.read_text(encoding="utf-8")
    unnamed = [m for m in sorted(modules) if not re.search(rf"\b{m}\b", text)]
    assert unnamed == [], f"core modules docs/ARCHITECTURE.md does not name: {unnamed}"
    drawn = drawn_floors()
    differ = {m: (FLOORS.get(m), drawn.get(m)) for m in sorted(modules | set(drawn)) if drawn.get(m) != FLOORS.get(m)}
    assert differ == {}, f"module: (floor here, floor in ARCHITECTURE.md's drawing): {differ}"


def test_the_imports_go_down_the_floors():
    upward = [
        f"{module} (floor {FLOORS[module]}) -> {imported} (floor {FLOORS[imported]})"
        for module, imports in sorted(import_graph().items())
        for imported in sorted(imports)
        if FLOORS[imported] > FLOORS[module]
    ]
    assert upward == [], "imports against the floors of docs/ARCHITECTURE.md: " + "; ".join(upward)


def rust_lines(path):
    """Non-blank lines of `path`, comments included, outside its `#[cfg(test)]` items."""
    text = path.read_text(encoding="utf-8")
    code = code_of_file(path)  # the same lines as `text`, where braces are the code's
    tested = set()
    for start, end in cfg_test_spans(code):
        tested.update(range(code.count("\n", 0, start), code.count("\n", 0, end) + 1))
    return sum(1 for number, line in enumerate(text.splitlines()) if line.strip() and number not in tested)


def test_the_bindings_are_at_most_a_quarter_of_the_rust():
    counted = [path for path in SRC.rglob("*.rs") if not is_test_file(path)]
    total = sum(rust_lines(path) for path in counted)
    bindings = sum(rust_lines(path) for path in counted if BINDINGS in path.parents)
    assert bindings / total <= 0.25, f"bindings: {bindings} of {total} non-test lines ({bindings / total:.0%})"
