"""The workload library (``throughput/workloads.py``, issue 30 item 4), without a server.

Per category: the prompts are there (a category with no prompts fails, it is never skipped), within
their length bounds, at their temperatures, and held out: every prompt's source document is a
held-out one by its corpus module's own ``is_heldout`` rule (always checked: the rule reads only the
path), and, where the corpus is installed with the same text, the prompt really is that document's
text at the recorded offset. ``copy`` prompts repeat: the expected output is in the prompt. The
mixed stream holds every category in every block of four and is the same in every process; its
schedules have the shape ``throughput.bench.run_phases`` takes. The older helpers still return what
they returned before the library was added.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest

from vllm_specplugin.models import corpus, prose
from vllm_specplugin.throughput import workloads as W

REPO = Path(__file__).resolve().parent.parent
# Listed here rather than read from the library, so that a category dropped from CATEGORIES (or
# from the file) fails below instead of silently leaving the parametrisation.
EXPECTED = ("code", "prose", "copy", "creative", "mixed")
TEXT = ("code", "prose", "copy", "creative")
CORPUS_MODULES = {"code": corpus, "prose": prose}


def test_the_library_has_its_five_categories():
    assert tuple(W.CATEGORIES) == EXPECTED
    assert W.TEXT_CATEGORIES == TEXT
    assert W.CATEGORIES["mixed"].parts == TEXT
    assert set(W.workload_file()["categories"]) == set(TEXT)
    for name in EXPECTED:
        assert W.CATEGORIES[name].name == name


@pytest.mark.parametrize("name", EXPECTED)
def test_prompts_are_there_within_bounds_and_at_their_temperature(name):
    category = W.CATEGORIES[name]
    prompts = W.category_prompts(name)
    assert category.count > 0 and len(prompts) == category.count, f"{name}: {len(prompts)} prompts"
    low, high = category.length
    for p in prompts:
        assert p.text.strip(), f"{name}: an empty prompt from {p.source}"
        assert low <= len(p.text) <= high, f"{name}: {len(p.text)} characters ({p.source})"
        assert p.category == name or p.category in category.parts
        assert p.temperature == W.CATEGORIES[p.category].temperatures[0]
    for p in W.category_prompts(name, setting=1):
        assert p.temperature == W.CATEGORIES[p.category].temperatures[1]
    assert [p.text for p in W.category_prompts(name, 3)] == [p.text for p in prompts[:3]]


def test_temperatures_per_category():
    for name in ("code", "prose", "copy"):
        assert W.CATEGORIES[name].temperatures == (0.0, 1.0)
    assert all(1.0 <= t <= 1.3 for t in W.CATEGORIES["creative"].temperatures)
    assert W.CATEGORIES["creative"].temperature == 1.0


@pytest.mark.parametrize("name", TEXT)
def test_every_prompt_comes_from_a_heldout_document(name):
    prompts = W.category_prompts(name)
    assert prompts, f"no {name} prompts: a check that visits nothing must not pass"
    for p in prompts:
        module = CORPUS_MODULES[p.corpus]  # KeyError for an unknown corpus
        assert module.is_heldout(p.source), f"{name}: {p.corpus}:{p.source} is in the training split"
        assert W.is_heldout_source(p.corpus, p.source), f"{name}: {p.source} is a path the corpus skips"


@pytest.mark.parametrize("name", TEXT)
def test_prompt_text_is_its_heldout_document_text(name):
    prompts = W.category_prompts(name)
    assert prompts
    checked, absent, other_text = 0, set(), set()
    for p in prompts:
        doc = W.read_source(p.corpus, p.source)
        if doc is None:
            absent.add(f"{p.corpus}:{p.source}")
            continue
        if W.doc_sha256(doc) != p.doc_sha256:
            other_text.add(f"{p.corpus}:{p.source}")
            continue
        assert doc[p.offset: p.offset + p.excerpt_len] == p.excerpt, f"{name}: {p.source} at {p.offset}"
        assert p.excerpt in doc
        checked += 1
    why = (f"{len(absent)} source documents absent on this machine (the code corpus is this "
           f"interpreter's stdlib; the prose corpus is Debian's python3.11-doc, which CI does not install), "
           f"{len(other_text)} with another text than the prompts were cut from (another Python or "
           f"python3.11-doc version)")
    if not checked:
        pytest.skip(f"no {name} prompt could be checked against its document: {why}")
    if absent or other_text:
        warnings.warn(f"{name}: {checked} prompts checked against their documents; not checked: {why}")


def test_copy_prompts_repeat_their_passage():
    prompts = W.category_prompts("copy")
    assert prompts
    for p in prompts:
        rest = p.continuation
        assert rest and rest.strip(), p.source
        head = p.excerpt[: p.excerpt_len - len(rest)]
        assert head.strip() and p.excerpt == head + rest, p.source
        # The passage, a blank line, its beginning again: the output should be the rest of it.
        assert p.text == p.excerpt + "\n" + head, p.source
        assert (head + rest) in p.text and p.text.count(head) >= 2
        assert len(rest) >= len(head), f"{p.source}: less than half the passage is left to repeat"
    assert {p.corpus for p in prompts} == {"code", "prose"}
    for name in ("code", "prose", "creative"):
        assert all(p.continuation is None and p.excerpt == p.text for p in W.category_prompts(name))


def test_code_category_is_the_heldout_prompts():
    assert [p.text for p in W.category_prompts("code")] == W.heldout_prompts()


def test_categories_do_not_share_passages():
    texts = [p.excerpt for name in TEXT for p in W.category_prompts(name)]
    assert len(texts) == sum(W.CATEGORIES[name].count for name in TEXT) > 0
    assert len(set(texts)) == len(texts), "two prompts share a passage"
    spans: dict[str, list[tuple[int, int]]] = {}
    for name in ("prose", "creative", "copy"):
        for p in W.category_prompts(name):
            if p.corpus == "prose":
                spans.setdefault(p.source, []).append((p.offset, p.offset + p.excerpt_len))
    for source, intervals in spans.items():
        intervals.sort()
        for (_, end), (start, _) in zip(intervals, intervals[1:]):
            assert end <= start, f"overlapping prose passages in {source}"


def test_mixed_stream_interleaves_every_category_deterministically():
    stream = W.mixed_requests(200, seed=0)
    assert len(stream) == 200
    for b in range(0, 200, 4):
        assert sorted(p.category for p in stream[b: b + 4]) == sorted(TEXT), f"block {b // 4}"
    assert W.mixed_requests(200, seed=0) == stream
    assert W.mixed_requests(9, seed=0) == stream[:9]
    assert [p.text for p in W.mixed_requests(200, seed=1)] != [p.text for p in stream]
    assert len({p.text for p in stream[:192]}) == 192  # no prompt repeats before the pools run out
    assert W.category_prompts("mixed") == stream[:192]
    for setting in (0, 1):
        for p in W.mixed_requests(16, setting=setting):
            assert p.temperature == W.CATEGORIES[p.category].temperatures[setting]


def test_mixed_stream_is_the_same_in_another_process():
    code = ("from vllm_specplugin.throughput.workloads import mixed_requests as m; "
            "print([(p.category, p.source, p.offset) for p in m(64, seed=3)])")
    outputs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONHASHSEED": str(hash_seed)}).stdout
        for hash_seed in (1, 2)
    }
    assert len(outputs) == 1
    here = str([(p.category, p.source, p.offset) for p in W.mixed_requests(64, seed=3)])
    assert outputs == {here + "\n"}


def test_mixed_phases_follow_the_schedule_in_bench_shape():
    shapes = W.MIXED_PHASES
    assert [c for _, c in shapes["bursty"]] == [1, 48, 1]
    assert {shape[0][1] for name, shape in shapes.items() if len(shape) == 1} == {1, 4, 16, 48}
    for name, shape in shapes.items():
        phases = W.mixed_phases(name, seed=0)
        assert [(len(prompts), c) for prompts, c in phases] == list(shape), name
        for prompts, concurrency in phases:
            assert len(prompts) >= concurrency and len(prompts) % 4 == 0
            assert {p.category for p in prompts} == set(TEXT), name
        everything = [p for prompts, _ in phases for p in prompts]
        assert everything == W.mixed_requests(len(everything), seed=0)
        # throughput.bench.run_phases / benchmark_workload(phases=...): [(list of prompts, int)]
        texts = W.phase_texts(phases)
        assert all(isinstance(ps, list) and all(isinstance(t, str) for t in ps) and isinstance(c, int)
                   for ps, c in texts)
        assert [t for ps, _ in texts for t in ps] == [p.text for p in everything]


def test_a_category_without_prompts_is_an_error(tmp_path, monkeypatch):
    data = json.loads(Path(W.WORKLOAD_FILE).read_text())
    data["categories"]["prose"] = []
    scratch = tmp_path / "prompts.json"
    scratch.write_text(json.dumps(data))
    monkeypatch.setenv(W.WORKLOAD_FILE_ENV, str(scratch))
    with pytest.raises(ValueError, match="no 'prose' prompts"):
        W.category_prompts("prose")
    with pytest.raises(ValueError):
        W.mixed_requests(4)
    with pytest.raises(ValueError, match="only 48"):
        W.category_prompts("code", 49)
    with pytest.raises(KeyError):
        W.category_prompts("poetry")


def test_shipped_prompts_are_what_the_recipe_makes():
    shipped = W.workload_file()
    present = {key: W.read_source(*key.split(":", 1)) for key in shipped["documents"]}
    differing = [key for key, doc in present.items() if doc is None or W.doc_sha256(doc) != shipped["documents"][key]]
    if differing:
        pytest.skip(f"{len(differing)} of {len(present)} source documents are absent or another text on this "
                    f"machine (e.g. {differing[0]}), so the recipe cannot be replayed here")
    made = W.make_workload_prompts(shipped["seed"])
    assert made["documents"] == shipped["documents"]
    for name in TEXT:
        assert made["categories"][name] == shipped["categories"][name], name


def test_recipe_reads_rest_paragraphs():
    text = (
        "Title\n=====\n\n"
        ".. function:: f(x)\n\n"
        "   Return the value of *x* doubled, which is what callers expect. It never fails here.\n"
        "   Callers may rely on that for every input they pass.\n\n"
        "   For example::\n\n"
        "      this is a literal block, with words enough to look like prose to a naive test.\n\n"
        "   A second paragraph of prose follows the example, written in plain English words.\n"
    )
    paragraphs = W._prose_paragraphs(text)
    prose_texts = [text[s:e] for s, e, is_prose in paragraphs if is_prose]
    assert [t.split()[0] for t in prose_texts] == ["Return", "A"]  # not the title, directive, literal
    start, end = next((s, e) for s, e, is_prose in paragraphs if is_prose)
    cuts = W._sentence_cuts(text, start, end, 10, 400, False)
    ends = ("callers expect.", "never fails here.\n", "they pass.\n")  # a line end goes with its sentence
    assert len(cuts) == 3 and all(text[start:c].endswith(tail) for c, tail in zip(cuts, ends))
    assert W._sentence_cuts(text, start, end, 10, 400, True) == cuts[1:]
    code = "class A:\n    def f(self, x):\n        return x + 1\n\n    y = 2\n"
    ((s, signature_end, e),) = W._def_blocks(code)
    assert code[s:signature_end] == "    def f(self, x):\n" and code[signature_end:e] == "        return x + 1\n"


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()[:16]


def test_older_helpers_are_unchanged():
    # Digests of their outputs taken before the workload library was added (benchmarks compare
    # runs over time, so the same call must keep sending the same text).
    assert _digest(W.heldout_prompts()) == "fd32cec14aad7fbb"
    assert _digest(W.repetitive_code_prompts(8)) == "eb51e5556c25aeb9"
    assert _digest(W.unpredictable_prompts(8)) == "9907fb700d8640cd"
    assert _digest(W.shared_system_prompt_requests(32)) == "084ba26608d067ac"


def test_prompts_file_ships_in_the_wheel():
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert {"heldout_prompts.json", "workload_prompts.json"} <= set(package_data["vllm_specplugin.throughput"])
    assert Path(W.WORKLOAD_FILE).parent == REPO / "throughput"


def test_cli_help_and_summary(capsys):
    with pytest.raises(SystemExit) as exit_:
        W.main(["--help"])
    assert exit_.value.code == 0
    assert "--write" in capsys.readouterr().out
    assert W.main([]) == 0
    out = capsys.readouterr().out
    for name in EXPECTED:
        assert f"\n{name} " in out
    assert "bursty: 4 x 1 -> 48 x 48 -> 4 x 1" in out
