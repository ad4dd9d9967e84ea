"""The README and the documentation show only real outputs: each is a capture that
docs/capture.py retakes from a notebook, script or command in the repository."""

import ast
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
INCLUDE = re.compile(r'^--8<-- "docs/captures/([\w-]+)\.txt"$', re.M)
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
# The first lines of what gpuexp prints: a report's title, or a table's top border.
GPUEXP_OUTPUT = re.compile(r"^(gpuexp · |┌)", re.M)
# What the site's build needs; the Makefile's DOCS_DEPS installs them (make test does).
DOCS_PACKAGES = ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers")


def capture_module():
    spec = importlib.util.spec_from_file_location("capture", ROOT / "docs" / "capture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_starts_with_the_two_commands_and_stays_a_tour():
    text = README.read_text(encoding="utf-8")
    assert text.startswith("# gpuexp\n\n```\nmake demo\nmake test\n```\n")
    assert len(text.splitlines()) <= 250


def test_the_readme_examples_are_their_captures_to_the_character():
    capture = capture_module()
    readme = README.read_text(encoding="utf-8")
    blocks = list(capture.README_BLOCK.finditer(readme))
    assert [block["name"] for block in blocks] == list(capture.README_CAPTURES)
    for block in blocks:
        expected = (capture.CAPTURES_DIR / f"{block['name']}.txt").read_text(encoding="utf-8")
        assert block["body"] == expected, "run `python docs/capture.py --readme`"
    assert capture.readme_with_captures(readme) == readme


def test_every_included_capture_exists_and_is_retaken_from_a_source_in_the_repo():
    capture = capture_module()
    included = {name for page in PAGES for name in INCLUDE.findall(page.read_text(encoding="utf-8"))}
    assert included, "no page includes a capture"
    files = {path.stem for path in capture.CAPTURES_DIR.glob("*.txt")}
    assert included <= set(capture.CAPTURES), f"no recipe for {included - set(capture.CAPTURES)}"
    assert files <= set(capture.CAPTURES), f"captures no recipe retakes: {files - set(capture.CAPTURES)}"
    assert included <= files, f"included but never taken: {included - files}"
    machines = json.loads(capture.MACHINES.read_text(encoding="utf-8"))
    for name in included:
        recipe = capture.CAPTURES[name]
        assert machines[name]["by"] == recipe.source(), f"{name} was taken from something else"
        if recipe.notebook:
            notebook = nbformat.read(ROOT / recipe.notebook, as_version=4)
            assert any("capture" in cell.metadata.get("tags", []) for cell in notebook.cells), recipe.notebook
        else:
            script = recipe.command.split()[1] if recipe.command.startswith("python ") else None
            assert script is None or (ROOT / script).is_file(), recipe.command


def test_no_page_shows_a_gpuexp_output_typed_by_hand():
    for page in [README, *PAGES]:
        text = page.read_text(encoding="utf-8")
        if page == README:
            text = capture_module().README_BLOCK.sub("", text)
        for block in FENCE.findall(text):
            if INCLUDE.search(block):
                continue
            assert not GPUEXP_OUTPUT.search(block), f"{page.name}: an output typed by hand:\n{block[:300]}"


def makefile_docs_command():
    """The environment and mkdocs arguments of the Makefile's `docs` recipe, as `make docs` runs it."""
    recipe = re.search(r"^docs:.*\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(encoding="utf-8"), re.M)
    assert recipe, "the Makefile has no docs target"
    words = shlex.split(next(line for line in recipe[1].splitlines() if "mkdocs " in line))
    at = next(i for i, word in enumerate(words) if word.endswith("/mkdocs") or word == "mkdocs")
    env = dict(word.split("=", 1) for word in words[:at])
    return env, words[at + 1 :]


def build_a_copy(tmp_path, broken_link=None):
    """Builds a copy of the docs with the Makefile's `docs` command, ``broken_link`` added to
    index.md; returns mkdocs' exit status and output."""
    missing = [name for name in DOCS_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f"the docs build needs {', '.join(missing)}: `make docs` installs mkdocs, "
                    "mkdocs-material and mkdocstrings[python] into .venv")
    ignore = shutil.ignore_patterns("__pycache__", "*.so")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path)
    shutil.copytree(ROOT / "docs", tmp_path / "docs", ignore=ignore)
    shutil.copytree(ROOT / "python", tmp_path / "python", ignore=ignore)
    if broken_link:
        page = tmp_path / "docs" / "index.md"
        page.write_text(page.read_text(encoding="utf-8") + f"\nSee [the gone page]({broken_link}).\n", encoding="utf-8")
    env, arguments = makefile_docs_command()
    assert "--strict" in arguments
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", *arguments, "--site-dir", str(tmp_path / "site")],
        cwd=tmp_path, env={**os.environ, **env}, capture_output=True, text=True, timeout=600,
    )
    return done.returncode, done.stdout + done.stderr


def test_the_docs_build_fails_on_a_broken_link(tmp_path):
    status, output = build_a_copy(tmp_path, broken_link="no-such-page.md")
    assert status != 0, f"`make docs` passed a broken link:\n{output}"
    assert "no-such-page.md" in output and "strict mode" in output, output
    # The planted link is the only warning: the site itself builds clean.
    assert "Aborted with 1 warnings in strict mode" in output, output


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The site built from a copy of the docs, as `make docs` builds it."""
    folder = tmp_path_factory.mktemp("docs")
    status, output = build_a_copy(folder)
    assert status == 0, output
    return folder / "site"


def test_the_site_works_from_disk(site):
    """Opened as file://, a browser shows a folder's listing, not its index.html: every link
    between pages must name a file, and search must not need a server."""
    pages = sorted(site.glob("*.html"))
    assert len(pages) > 20, "the site has fewer pages than the nav"
    broken = []
    for page in pages:
        for target in re.findall(r'(?:href|src)="([^"#?]+)', page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target) or page.name == "404.html":
                continue  # another site, or the page a server shows for a missing one
            if not (page.parent / target).is_file():
                broken.append(f"{page.name} -> {target}")
    assert not broken, f"links that open nothing from disk: {broken[:20]}"
    assert (site / "search" / "search_index.js").is_file(), "search needs a server: no bundled index"


def test_the_api_page_has_every_public_name_each_with_its_text(site):
    init = ast.parse((ROOT / "python" / "gpuexp" / "__init__.py").read_text(encoding="utf-8"))
    public = next(ast.literal_eval(node.value) for node in init.body
                  if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets))
    page = (site / "api.html").read_text(encoding="utf-8")
    found = re.findall(r'<div class="doc doc-object doc-(\w+)">\s*<h\d id="([\w.]+)"', page)
    kinds = {identifier: kind for kind, identifier in found}
    directives = re.findall(r"^::: ([\w.]+)$", (ROOT / "docs" / "api.md").read_text(encoding="utf-8"), re.M)
    entries = {directive.rsplit(".", 1)[-1]: kinds.get(directive) for directive in directives}
    absent = [name for name in public if entries.get(name) not in ("class", "function")]
    assert not absent, f"docs/api.md has no entry (or a module's) for {absent}"
    empty = [identifier for identifier in re.findall(
        r'<h\d id="([\w.]+)" class="doc doc-heading">(?:(?!<h\d).)*?<div class="doc doc-contents[^"]*">\s*</div>',
        page, re.S)]
    assert not empty, f"entries without text on the API page: {empty}"
    assert "_Table" not in page, "the API page names _core.pyi's _Table, which no user can import"
    text = re.sub(r"<[^>]+>", "", re.sub(r"<script\b.*?</script>", "", page, flags=re.S))
    private_defaults = sorted(set(re.findall(r"\w+=_\w+", text)))
    assert not private_defaults, f"signatures whose default is a private name no reader can use: {private_defaults}"
    assert 'live_view_after_s="unchanged"' in text.replace("&quot;", '"').replace("&#39;", "'"), "config's default"


def test_the_gpu_suites_four_commands_name_every_gpu_test_file_once():
    """docs/testing-gpu.md splits `pytest -m gpu` into calls that each fit the device's 10 minutes:
    a new GPU test file left out of them would never run there."""
    text = (ROOT / "docs" / "testing-gpu.md").read_text(encoding="utf-8")
    commands = text.split("## The whole suite within the device's limits", 1)[1]
    named = re.findall(r"tests/(test_gpu\w*\.py)", commands)
    files = sorted(path.name for path in (ROOT / "tests").glob("test_gpu*.py"))
    twice = sorted({n for n in named if named.count(n) > 1})
    assert sorted(named) == files, f"missing: {set(files) - set(named)}; twice: {twice}"
