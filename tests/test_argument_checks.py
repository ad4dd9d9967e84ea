"""Each argument the public functions share is checked in one place (issue 31, "one funnel"):
a second copy of a check drifts from the first, in what it accepts and in what it says."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = [*ROOT.joinpath("python", "gpuexp").rglob("*.py"), *ROOT.joinpath("rust", "src").rglob("*.rs")]


def places(pattern):
    found = []
    for path in SOURCES:
        if path.name.endswith("tests.rs") or path.parent.name == "tests":
            continue
        text = path.read_text(encoding="utf-8")
        lines = (text.count("\n", 0, match.start()) + 1 for match in re.finditer(pattern, text))
        found += [f"{path.relative_to(ROOT)}:{line}" for line in lines]
    return found


def test_step_is_checked_in_one_place():
    assert len(places(r"must be a function of the batch size")) == 1, places(r"must be a function of the batch size")
    assert places(r"callable\(step\)") == [], "step is checked by _core.check_step"


def test_a_positive_int_is_checked_in_one_place():
    assert len(places(r"must be a positive int")) == 1, places(r"must be a positive int")
    spelled_out = places(r"isinstance\((\w+), bool\) or not isinstance\(\1, int\) or \1 < 1")
    assert len(spelled_out) == 1, f"use experiment.count: {spelled_out}"


def test_a_size_is_parsed_in_one_place():
    assert len(places(r"_core\.parse_size\(")) == 1, places(r"_core\.parse_size\(")
