"""Rewrites the docstrings of python/gpuexp/_core.pyi from the built module's.

The doc comments in rust/src/bindings/ are the one source of the native module's help text. PyO3
makes each `///` on a #[pyclass], a #[pymethods] function, a #[getter] or a #[pyfunction] its
object's ``__doc__``. This script copies those texts into the stub, where editors and the API
page (mkdocstrings reads the stub without importing anything) find them. The stub's signatures
stay written by hand.

    python docs/stub.py           # rewrites python/gpuexp/_core.pyi from the installed gpuexp._core
    python docs/stub.py --check   # lists what differs, exits 1 if anything does

Which docstring comes from where:
- a class, function, method or property of the stub that the module has: its ``__doc__``
  (none: the stub has none either);
- a stub-only base class (``_Table``): the methods of the first class that derives from it;
- CPython's slots (``__len__``, ``__str__``, ``__new__``) and the stub-only types (the Protocols,
  the TypedDict): the stub's own text.

tests/test_native_stub.py fails when the stub's docstrings and the module's differ.
"""

import argparse
import ast
import inspect
import io
import sys
import tokenize
import types
from pathlib import Path

STUB = Path(__file__).resolve().parent.parent / "python" / "gpuexp" / "_core.pyi"
# What CPython's slots and builtins carry: generic text ("Return len(self)."), not the bindings'.
NOT_FROM_THE_BINDINGS = (types.WrapperDescriptorType, types.BuiltinFunctionType, types.BuiltinMethodType)


def cleaned(doc):
    """A docstring as ``ast.get_docstring`` reads it back; None for no text."""
    return inspect.cleandoc(doc) if doc and doc.strip() else None


def wanted_docstrings(tree, core):
    """{stub node: (its qualified name, the docstring it should have)} for each node whose text
    the module owns."""
    wanted = {}
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and hasattr(core, node.name):
            wanted[node] = (node.name, cleaned(getattr(core, node.name).__doc__))
        elif isinstance(node, ast.ClassDef):
            runtime = runtime_class(node, classes, core)
            if runtime is None:
                continue
            if hasattr(core, node.name):
                wanted[node] = (node.name, cleaned(runtime.__doc__))
            for member in node.body:
                if isinstance(member, ast.FunctionDef) and member.name in vars(runtime):
                    if not isinstance(vars(runtime)[member.name], NOT_FROM_THE_BINDINGS):
                        doc = cleaned(getattr(runtime, member.name).__doc__)
                        wanted[member] = (f"{node.name}.{member.name}", doc)
    return wanted


def differences(text, core):
    """The qualified names whose docstring in the stub's ``text`` is not the module's."""
    return [name for node, (name, doc) in wanted_docstrings(ast.parse(text), core).items()
            if cleaned(ast.get_docstring(node, clean=False)) != doc]


def runtime_class(node, classes, core):
    """The module's class for a stub class; for a stub-only base, the first class deriving from it."""
    if hasattr(core, node.name):
        return getattr(core, node.name)
    for other in classes.values():
        if hasattr(core, other.name) and any(isinstance(b, ast.Name) and b.id == node.name for b in other.bases):
            return getattr(core, other.name)
    return None


def rewritten(text, core):
    """The stub's text with each docstring the module owns replaced by the module's."""
    tree = ast.parse(text)
    starts = line_starts(text)
    colons = header_colons(text)
    edits = []
    for node, (_, doc) in wanted_docstrings(tree, core).items():
        present = ast.get_docstring(node, clean=False)
        if cleaned(present) == doc:
            continue
        indent = " " * (node.col_offset + 4)
        first = node.body[0]
        first_start = offset(starts, text, first.lineno, first.col_offset)
        first_end = offset(starts, text, first.end_lineno, first.end_col_offset)
        after_colon = next(at for at in colons if at > offset(starts, text, node.lineno, node.col_offset)) + 1
        if present is not None and len(node.body) > 1:  # a class's docstring, before its members
            edits.append((first_start, first_end, quoted(doc, indent)) if doc
                         else (text.rindex("\n", 0, first_start), first_end, ""))
        elif present is not None or is_ellipsis(first):  # `: ...` or a docstring alone
            edits.append((after_colon, first_end, f"\n{indent}{quoted(doc, indent)}" if doc else " ..."))
        else:  # members without a docstring: a blank line parts it from them
            edits.append((after_colon, after_colon, f"\n{indent}{quoted(doc, indent)}\n"))
    for start, end, new in sorted(edits, reverse=True):
        text = text[:start] + new + text[end:]
    return text


def is_ellipsis(statement):
    return (isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)
            and statement.value.value is Ellipsis)


def quoted(doc, indent):
    """``doc`` as a triple-quoted literal whose later lines start at ``indent``."""
    body = doc.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')
    if body.endswith('"'):
        body = body[:-1] + '\\"'
    lines = body.split("\n")
    return '"""' + "\n".join([lines[0]] + [indent + line if line else "" for line in lines[1:]]) + '"""'


def line_starts(text):
    starts, at = [0], 0
    for line in text.splitlines(keepends=True):
        at += len(line)
        starts.append(at)
    return starts


def offset(starts, text, lineno, col_bytes):
    """The character offset of an ast position (its column counts UTF-8 bytes)."""
    line = text[starts[lineno - 1] : starts[lineno]]
    return starts[lineno - 1] + len(line.encode("utf-8")[:col_bytes].decode("utf-8"))


def header_colons(text):
    """The character offsets of every ':' outside brackets: a def's or a class's header ends at one."""
    starts = line_starts(text)
    colons, depth = [], 0
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.OP:
            if token.string in "([{":
                depth += 1
            elif token.string in ")]}":
                depth -= 1
            elif token.string == ":" and depth == 0:
                colons.append(starts[token.start[0] - 1] + token.start[1])
    return colons


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 where the stub differs")
    args = parser.parse_args()
    import gpuexp._core as core

    text = STUB.read_text(encoding="utf-8")
    new = rewritten(text, core)
    if new == text:
        print(f"{STUB.name}: its docstrings are the module's")
        return 0
    if args.check:
        print(f"{STUB.name}: these docstrings differ from {core.__file__}'s (run python docs/stub.py):")
        print("\n".join(f"  {name}" for name in differences(text, core)))
        return 1
    STUB.write_text(new, encoding="utf-8")
    print(f"{STUB.name}: docstrings rewritten from {core.__file__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
