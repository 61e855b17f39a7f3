"""The documentation cites only what exists (issues 29 and 32).

* Every repository path that README.md and docs/**/*.md cite exists: paths in backticks (alone or
  inside an inline command) that start with a top-level folder of the repository or name a
  top-level file, markdown links and images (relative to their page), ``file::test`` citations
  (the test must be defined in that file), globs (they must match a file) and the ``#anchor`` of a
  link to a page (a heading of that page). "Exists" means: tracked by git, or a file git does not
  ignore (a page not committed yet), so that a fresh clone has it. Outputs that a command writes
  are named in plain text; inside a command, the path after an output option (``--json``,
  ``--plot``, ``--out``, ...) is an output, not a citation. Fenced code blocks are commands, not
  citations.
* The number of cases cited for the statistical suite's Holm family is ``SUITE_HYPOTHESES``.
* docs/configuration.md is generated from ``SpecPluginConfig`` and has a section per key.
* Every ``specplugin:`` metric name is one that ``/metrics`` serves (counters with ``_total``).
* ``make clean`` never deletes a tracked file.
"""

from __future__ import annotations

import ast
import dataclasses
import fnmatch
import importlib.util
import itertools
import os
import re
import shutil
import subprocess
from pathlib import Path, PurePosixPath

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
SUITE_MODULE = ROOT / "tests" / "statistical" / "test_stat_engine_exactness.py"
HF_SUITE_MODULE = ROOT / "tests" / "statistical" / "test_stat_hf_generate.py"
CONFIG_PAGE = ROOT / "docs" / "configuration.md"

# In a command, the argument after one of these is what the command writes.
OUTPUT_OPTIONS = {"--json", "--plot", "--out", "--out-dir", "-o", "-w", "--benchmark-json", "--card-out"}
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
CODE_SPAN = re.compile(r"`((?:[^`\n]|\n(?![ \t]*\n))+)`")
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)


# -- what exists ---------------------------------------------------------------------------------

def repository_files(root: Path = ROOT) -> set[str]:
    """Files a fresh clone has: tracked ones, plus untracked ones git does not ignore."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                             cwd=root, capture_output=True, check=True, timeout=60).stdout
        files = {f for f in out.decode().split("\0") if f}
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: what is on disk
        skip = {".git", ".venv", "__pycache__", ".pytest_cache", ".hypothesis", "build", "dist"}
        files = set()
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d not in skip and not d.endswith(".egg-info")]
            rel = Path(dirpath).relative_to(root)
            files.update((rel / f).as_posix() for f in filenames)
    return {f for f in files if (root / f).exists()}  # a tracked file deleted in the work tree is gone


def directories(files: set[str]) -> set[str]:
    return {p.as_posix() for f in files for p in PurePosixPath(f).parents if p.as_posix() != "."}


# -- what a page cites ---------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Citation:
    page: str
    kind: str  # "code" | "link"
    target: str  # repository-relative path (may hold a glob), "::test" and "#anchor" split off
    test: str | None = None
    anchor: str | None = None


def strip_fences(text: str) -> str:
    return FENCE.sub("", text)


def _expand_braces(token: str) -> list[str]:
    match = re.search(r"\{([^{}]*,[^{}]*)\}", token)
    if not match:
        return [token]
    return list(itertools.chain.from_iterable(
        _expand_braces(token[:match.start()] + part + token[match.end():]) for part in match.group(1).split(",")))


def _clean(token: str) -> str:
    token = token.strip().lstrip("\"'([{<").rstrip("\"'()[]{}<>,;:.!?")
    return token


def is_repository_path(token: str, top_dirs: set[str], top_files: set[str]) -> bool:
    if token in top_files:
        return True
    head, sep, _ = token.partition("/")
    return bool(sep) and head in top_dirs


def citations(page: Path, text: str, top_dirs: set[str], top_files: set[str]) -> list[Citation]:
    """Every repository path ``text`` (the content of ``page``) cites."""
    name = page.relative_to(ROOT).as_posix() if page.is_relative_to(ROOT) else page.name
    body = strip_fences(text)
    found: list[Citation] = []
    for span in CODE_SPAN.findall(body):
        tokens = span.split()
        for previous, raw in zip([None] + tokens[:-1], tokens):
            if previous in OUTPUT_OPTIONS or raw.startswith("-"):
                continue
            for expanded in _expand_braces(raw):
                path, _, test = _clean(expanded).partition("::")
                if is_repository_path(path, top_dirs, top_files):
                    found.append(Citation(name, "code", path.rstrip("/") or path, test or None))
    for url in LINK.findall(body):
        if re.match(r"^[a-z][a-z0-9+.-]*:", url):  # http:, https:, mailto:
            continue
        path, _, anchor = url.partition("#")
        if not path:  # an anchor on the same page
            found.append(Citation(name, "link", name, anchor=anchor or None))
            continue
        resolved = os.path.normpath(os.path.join(os.path.dirname(name), path)).replace(os.sep, "/")
        found.append(Citation(name, "link", resolved, anchor=anchor or None))
    return found


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, title in HEADING.findall(strip_fences(text)):
        base = slug(title)
        count = seen.get(base, 0)
        out.add(base if count == 0 else f"{base}-{count}")
        seen[base] = count + 1
    return out


def problems(cites: list[Citation], files: set[str], read=lambda p: (ROOT / p).read_text()) -> list[str]:
    """Why each citation that does not hold fails, as 'page: target: reason'."""
    dirs = directories(files)
    out = []
    for c in cites:
        if c.target.startswith("../") or c.target == "..":
            out.append(f"{c.page}: {c.target}: outside the repository")
            continue
        if any(ch in c.target for ch in "*?["):
            if not any(fnmatch.fnmatchcase(f, c.target) for f in files):
                out.append(f"{c.page}: {c.target}: the glob matches no file")
            continue
        if c.target not in files and c.target not in dirs:
            out.append(f"{c.page}: {c.target}: no such file or folder in the repository")
            continue
        if c.test:
            if c.target not in files or not re.search(rf"^\s*(async\s+)?def {re.escape(c.test)}\b",
                                                      read(c.target), re.M):
                out.append(f"{c.page}: {c.target}::{c.test}: no such test there")
        if c.anchor:
            if not c.target.endswith(".md") or c.anchor not in anchors(read(c.target)):
                out.append(f"{c.page}: {c.target}#{c.anchor}: no such heading")
    return out


def _tops(files: set[str]) -> tuple[set[str], set[str]]:
    top_dirs = {f.split("/")[0] for f in files if "/" in f}
    top_files = {f for f in files if "/" not in f}
    return top_dirs, top_files


@pytest.fixture(scope="module")
def files() -> set[str]:
    return repository_files()


@pytest.fixture(scope="module")
def all_citations(files) -> list[Citation]:
    top_dirs, top_files = _tops(files)
    return [c for page in PAGES for c in citations(page, page.read_text(), top_dirs, top_files)]


def test_every_cited_repository_path_exists(files, all_citations):
    assert all_citations, "no citations found in README.md and docs/: the scan is broken"
    # Each kind of citation must be found, or a broken pattern would pass silently.
    kinds = {"code": [c for c in all_citations if c.kind == "code"],
             "link": [c for c in all_citations if c.kind == "link"],
             "test": [c for c in all_citations if c.test],
             "anchor": [c for c in all_citations if c.anchor],
             "README": [c for c in all_citations if c.page == "README.md"]}
    assert all(kinds.values()), {k: len(v) for k, v in kinds.items()}
    bad = problems(all_citations, files)
    assert not bad, "cited but missing:\n" + "\n".join(bad)


def test_every_page_is_linked_from_the_index():
    index = (ROOT / "docs" / "index.md").read_text()
    linked = {os.path.normpath(os.path.join("docs", url.partition("#")[0])) for url in LINK.findall(index)}
    pages = {p.relative_to(ROOT).as_posix() for p in PAGES if p.parent != ROOT and p.name != "index.md"}
    assert pages <= linked, sorted(pages - linked)


def test_the_scan_reports_what_is_missing(files):
    """The checker itself: a page citing missing things must be reported, item by item."""
    top_dirs, top_files = _tops(files)
    page = ROOT / "docs" / "scratch.md"
    text = "\n".join([
        "See `runs/bench/tree_verification-20261201-072926.md` and `models/demo-mb/bench-2099-*.md`.",
        "Run `pytest tests/test_plugin.py::test_no_such_test` or [this](strategies/missing.md).",
        "![plot](../models/demo-mb/no-such.png), [here](index.md#no-such-heading), [up](../../x.md).",
        "Fine: `README.md`, `proposers/tree.py: build_tree`, [index](index.md),",
        "`python -m x --json runs/new/output.json` (an output), `vllm/utils/cpu_triton_utils.py` (vLLM's).",
        "```bash", "cat runs/inside/a/fence.txt `runs/not/checked.md`", "```",
    ])
    cites = citations(page, text, top_dirs, top_files)
    targets = {c.target for c in cites}
    assert "runs/new/output.json" not in targets and "runs/not/checked.md" not in targets
    assert not any(t.startswith("vllm/") for t in targets)
    bad = problems(cites, files)
    for expected in ("tree_verification-20261201-072926.md", "bench-2099-*.md", "test_no_such_test",
                     "docs/strategies/missing.md", "models/demo-mb/no-such.png", "#no-such-heading",
                     "outside the repository"):
        assert any(expected in b for b in bad), (expected, bad)
    assert len(bad) == 7, bad
    assert citations(page, "no citation here", top_dirs, top_files) == []


# -- the statistical suite's size ----------------------------------------------------------------

def module_constant(path: Path, name: str):
    """A module-level constant computed from the module's own upper-case assignments (no import:
    the statistical modules import the engine drivers)."""
    namespace: dict = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if all(isinstance(t, ast.Name) and t.id.isupper() for t in targets):
                try:
                    exec(compile(ast.Module(body=[node], type_ignores=[]), str(path), "exec"), namespace)
                except Exception:  # an assignment that needs an import: not one SUITE uses
                    pass
    assert name in namespace, f"{path.name}: cannot compute {name}"
    return namespace[name]


SUITE_SIZE_CITATION = re.compile(r"\b(\d+) case p-values|\b(\d+) cases in one Holm family")


def test_cited_suite_size_is_suite_hypotheses():
    suite_hypotheses = module_constant(SUITE_MODULE, "SUITE_HYPOTHESES")
    cited = [(page.name, int(next(g for g in m.groups() if g)))
             for page in PAGES for m in SUITE_SIZE_CITATION.finditer(page.read_text())]
    assert cited, "the docs cite the suite's size nowhere: the scan is broken"
    assert all(n == suite_hypotheses for _, n in cited), (suite_hypotheses, cited)
    # The transformers suite's level, 0.01 / its SUITE_HYPOTHESES.
    hf = module_constant(HF_SUITE_MODULE, "SUITE_HYPOTHESES")
    levels = re.findall(r"α = 0\.01 / (\d+)", (ROOT / "docs" / "transformers.md").read_text())
    assert levels and all(int(n) == hf for n in levels), (hf, levels)


# -- the configuration reference -----------------------------------------------------------------

def _generator():
    spec = importlib.util.spec_from_file_location("gen_config_reference", ROOT / "docs" / "gen_config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generator():
    return _generator()


def _details(page_text: str, generator) -> str:
    """The hand-written part of the page: everything but the generated block."""
    return page_text.replace(generator.generated_block(page_text), "")


def test_config_reference_is_generated_from_the_code(generator):
    from vllm_specplugin.config import SpecPluginConfig

    parsed = [f["name"] for f in generator.fields_from_source()]
    assert parsed == [f.name for f in dataclasses.fields(SpecPluginConfig)]
    page = CONFIG_PAGE.read_text()
    assert generator.generated_block(page) == generator.render(), (
        "docs/configuration.md is out of date: run `make docs` (python docs/gen_config_reference.py)")


def test_config_reference_has_a_section_for_each_key_and_no_other(generator):
    from vllm_specplugin.config import SpecPluginConfig

    keys = {f.name for f in dataclasses.fields(SpecPluginConfig)}
    details = _details(CONFIG_PAGE.read_text(), generator)
    sections = set(re.findall(r"^### `(\w+)`\s*$", details, re.M))
    assert not keys - sections, f"keys without a section in docs/configuration.md: {sorted(keys - sections)}"
    assert not sections - keys, f"sections for keys that do not exist: {sorted(sections - keys)}"


def test_docs_name_only_sub_keys_that_exist_and_the_reference_names_all(generator):
    fields = generator.fields_from_source()
    accepted = {name: set(generator.accepted_subkeys(name)) for name in generator.object_keys(fields)}
    details = _details(CONFIG_PAGE.read_text(), generator)
    for name, subkeys in accepted.items():
        named = set(re.findall(rf"`{name}\.(\w+)", details))
        assert subkeys <= named, f"{name}: sub-keys missing from docs/configuration.md: {sorted(subkeys - named)}"
    dotted = re.compile(r"`(" + "|".join(accepted) + r")\.(\w+)")
    wrong = [(page.name, f"{parent}.{sub}") for page in PAGES
             for parent, sub in dotted.findall(page.read_text()) if sub not in accepted[parent]]
    assert not wrong, f"sub-keys the plugin refuses: {wrong}"


# -- metrics -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served_metrics(tmp_path_factory):
    from vllm_specplugin import metrics

    previous = os.environ.get(metrics.METRICS_DIR_ENV)
    os.environ[metrics.METRICS_DIR_ENV] = str(tmp_path_factory.mktemp("metrics"))
    try:
        families = list(metrics.SnapshotCollector().collect())
    finally:
        if previous is None:
            os.environ.pop(metrics.METRICS_DIR_ENV, None)
        else:
            os.environ[metrics.METRICS_DIR_ENV] = previous
    # Prometheus exposes a counter family X as X_total.
    return {f.name + "_total" if f.type == "counter" else f.name for f in families}


def test_metric_names_in_the_docs_are_served(served_metrics):
    assert served_metrics
    named = {(page.name, m) for page in PAGES for m in re.findall(r"specplugin:[a-z_]+", page.read_text())}
    assert named, "no metric named in the docs: the scan is broken"
    wrong = sorted((p, m) for p, m in named if m not in served_metrics)
    assert not wrong, f"not served by /metrics (a counter needs _total): {wrong}"


def test_observability_lists_every_metric(served_metrics):
    listed = set(re.findall(r"`(specplugin:[a-z_]+)", (ROOT / "docs" / "observability.md").read_text()))
    assert served_metrics <= listed, f"served but not in docs/observability.md: {sorted(served_metrics - listed)}"


# -- make clean ----------------------------------------------------------------------------------

@pytest.mark.skipif(shutil.which("make") is None or shutil.which("git") is None, reason="needs make and git")
def test_make_clean_keeps_tracked_files(tmp_path):
    """In a scratch repository with this Makefile: tracked files under runs/ survive, outputs go."""
    repo = tmp_path / "repo"
    (repo / "runs" / "bench").mkdir(parents=True)
    shutil.copy(ROOT / "Makefile", repo / "Makefile")
    (repo / ".gitignore").write_text("runs/\n.venv/\n")
    (repo / "runs" / "bench" / "cited.md").write_text("a committed result\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
    subprocess.run([*git, "init", "-q"], cwd=repo, check=True)
    subprocess.run([*git, "add", "-f", "Makefile", ".gitignore", "runs/bench/cited.md"], cwd=repo, check=True)
    subprocess.run([*git, "commit", "-q", "-m", "scratch"], cwd=repo, check=True)
    (repo / "runs" / "bench" / "output.md").write_text("an output\n")
    (repo / "runs" / "demo").mkdir()
    (repo / "runs" / "demo" / "demo.png").write_text("an output\n")
    (repo / ".venv").mkdir()
    subprocess.run(["make", "-s", "clean"], cwd=repo, check=True, capture_output=True, timeout=60)
    assert (repo / "runs" / "bench" / "cited.md").read_text() == "a committed result\n"
    assert not (repo / "runs" / "bench" / "output.md").exists()
    assert not (repo / "runs" / "demo").exists()
    assert not (repo / ".venv").exists()
