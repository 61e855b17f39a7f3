"""Workloads for benchmarks, the demo and the soak: held-out prompts the demo models never trained on.

Two prompt files ship with the package, so that every machine (CI has neither the prose corpus nor,
always, the same standard library) measures the same text:

* ``heldout_prompts.json``: 48 held-out code prompts (:func:`heldout_prompts`), made by
  :func:`make_heldout_prompts`; the benchmarks and the demo have used them since the first family.
* ``workload_prompts.json``: the workload library of issue 30 (below), made by
  :func:`make_workload_prompts` from the held-out documents of ``models/corpus.py`` (stdlib code)
  and ``models/prose.py`` (the Python documentation's reST sources) only.

The workload library: named categories (:data:`CATEGORIES`), each a :class:`Category` with its
sampling temperatures, prompt count and length bounds; :func:`category_prompts` returns a category's
prompts as :class:`Prompt` objects (text, category, temperature, source document);
:func:`mixed_requests` interleaves the four text categories deterministically, and
:data:`MIXED_PHASES` / :func:`mixed_phases` / :func:`phase_texts` give the mixed workload's
concurrency schedules in the ``[(prompts, concurrency), ...]`` shape of
``throughput.bench.run_phases`` / ``benchmark_workload(phases=...)``.

    python -m vllm_specplugin.throughput.workloads              # summary of the shipped prompts
    python -m vllm_specplugin.throughput.workloads --write      # regenerate (needs both corpora)
    python -m vllm_specplugin.throughput.workloads --verify     # regenerate and compare, write nothing
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import sys
from dataclasses import dataclass, replace
from functools import lru_cache

PROMPTS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "heldout_prompts.json")


def heldout_prompts(count: int | None = None) -> list[str]:
    """The first ``count`` held-out prompts (all when None)."""
    with open(PROMPTS_FILE) as f:
        prompts = [p["prompt"] for p in json.load(f)["prompts"]]
    if count is not None and count > len(prompts):
        raise ValueError(f"only {len(prompts)} held-out prompts, asked for {count}")
    return prompts[:count]


def make_heldout_prompts(seed: int = 0, limit: int = 48) -> list[dict]:
    """6 lines before a ``def`` and 3 after, two per held-out file, 150–700 characters."""
    from vllm_specplugin.models import corpus

    rng = random.Random(seed)
    prompts = []
    for source in sorted(corpus.load("heldout"), key=lambda f: f.relpath):
        lines = source.text.splitlines(keepends=True)
        starts = [i for i, line in enumerate(lines) if line.lstrip().startswith("def ")]
        rng.shuffle(starts)
        for i in starts[:2]:
            text = "".join(lines[max(0, i - 6): i + 3])
            if 150 <= len(text) <= 700:
                prompts.append({"source": source.relpath, "line": i + 1, "prompt": text})
    return prompts[:limit]


def repetitive_code_prompts(count: int) -> list[str]:
    """Predictable text: a few lines of held-out code repeated, so the continuation repeats too."""
    prompts = []
    for text in heldout_prompts(count):
        lines = [line for line in text.splitlines(keepends=True) if line.strip()][:3]
        prompts.append("".join(lines) * 5)
    return prompts


def unpredictable_prompts(count: int, length: int = 48, vocab_size: int = 4096, seed: int = 0) -> list[list[int]]:
    """Random token ids as prompts. The small family's drafts agree with its target less after
    them; the memory-bound family's distilled draft does not (offline, γ 4, 48 tokens, 4 prompts:
    α 0.975 at T = 0 and 0.92 at T = 1, against 0.914 / 0.956 on held-out code), so on that pair
    they are not a low-acceptance workload."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab_size, length).tolist() for _ in range(count)]


def shared_system_prompt_requests(count: int, system_tokens: int = 240) -> list[str]:
    """``count`` requests that start with one system prompt of about ``system_tokens`` demo tokens
    (held-out code, ~3.6 characters per token) and end with their own held-out prompt."""
    pool = heldout_prompts()
    system = ""
    index = 0
    while len(system) < system_tokens * 3.6:
        system += pool[index % len(pool)]
        index += 1
    system = system[: int(system_tokens * 3.6)]
    return [system + pool[(index + i) % len(pool)] for i in range(count)]


# ---------------------------------------------------------------------------------------------
# The workload library (issue 30 item 4): named categories of held-out prompts.

WORKLOAD_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workload_prompts.json")
# Another prompts file in place of the shipped one (a scratch copy, e.g. to see a test fail).
WORKLOAD_FILE_ENV = "SPECPLUGIN_WORKLOAD_PROMPTS"
RECIPE_SEED = 0
PROMPT_CHARS = (150, 700)  # every category's prompt length, characters (~40-200 demo tokens)
COPY_PASSAGE_CHARS = (150, 450)  # a copy prompt's passage; its repeated head keeps it under 700
COPY_HEAD_FRACTION = (0.25, 0.45)  # how much of a prose passage a copy prompt repeats before it stops


@dataclass(frozen=True)
class Category:
    """A named kind of request.

    ``temperatures``: (the "T = 0" setting, the "T = 1" setting) the benchmarks parametrise over,
    index 0 the default. Every category runs at 0.0 / 1.0 except ``creative``, which is served hot
    (1.0 / 1.3), where drafts disagree with the target most. ``count``: prompts shipped in
    ``workload_prompts.json`` (``mixed``: the others' together, each once). ``length``: inclusive
    bounds on a prompt's characters. ``parts``: the categories ``mixed`` interleaves (else empty).
    """

    name: str
    description: str
    temperatures: tuple[float, float]
    count: int
    length: tuple[int, int] = PROMPT_CHARS
    parts: tuple[str, ...] = ()

    @property
    def temperature(self) -> float:
        """The default sampling temperature (setting 0)."""
        return self.temperatures[0]


@dataclass(frozen=True)
class Prompt:
    """One request of a category.

    ``text[:excerpt_len]`` is verbatim text of the held-out document ``source`` of ``corpus``
    ("code": ``models/corpus.py``, a path under the stdlib root; "prose": ``models/prose.py``, a path
    under the documentation's ``_sources``), starting at character ``offset`` of the document as
    that module loads it (line endings normalised); ``doc_sha256`` (16 hex digits) identifies that
    document's text. ``excerpt_len == len(text)`` except for ``copy`` prompts, whose text goes on
    with a blank line and the excerpt's own beginning; ``continuation`` is then the expected
    output, the rest of the excerpt (None for the other categories).
    """

    text: str
    category: str
    temperature: float
    corpus: str
    source: str
    offset: int
    excerpt_len: int
    doc_sha256: str
    continuation: str | None = None

    @property
    def excerpt(self) -> str:
        return self.text[: self.excerpt_len]


TEXT_CATEGORIES = ("code", "prose", "copy", "creative")  # the ones with prompts of their own
CATEGORIES: dict[str, Category] = {
    "code": Category("code", "completion of held-out stdlib code: 6 lines before a def and 3 after "
                     "(the same 48 prompts as heldout_prompts())", (0.0, 1.0), 48),
    "prose": Category("prose", "continuation of held-out documentation: a paragraph or two of reST "
                      "text cut at a sentence end", (0.0, 1.0), 48),
    "copy": Category("copy", "the output repeats the prompt: a held-out passage (prose, or a code "
                     "def block), a blank line, and the passage's own beginning (a prose passage's "
                     "first 25-45 %, a def's signature); the expected output is the rest of the "
                     "passage. Alternately prose and code", (0.0, 1.0), 48),
    "creative": Category("creative", "held-out documentation (other passages than prose's) served "
                         "hot, where drafts disagree with the target most", (1.0, 1.3), 48),
    "mixed": Category("mixed", "the four categories interleaved: every block of four consecutive "
                      "requests holds one of each, in a seeded order; each request keeps its own "
                      "category's temperature", (0.0, 1.0), 0, parts=TEXT_CATEGORIES),
}
# mixed's count: every prompt of its parts once.
CATEGORIES["mixed"] = replace(CATEGORIES["mixed"], count=sum(CATEGORIES[n].count for n in TEXT_CATEGORIES))

# The mixed workload's concurrency schedules: name -> ((requests, concurrency), ...), one entry per
# phase run one after another; the shape of throughput.bench.run_phases' ``phases`` with the prompt
# list replaced by its length (mixed_phases fills it in). Every phase's size is a multiple of 4, so
# each phase holds every category equally. At least 2 requests per client (as make demo sends).
MIXED_PHASES: dict[str, tuple[tuple[int, int], ...]] = {
    "c1": ((8, 1),),
    "c4": ((8, 4),),
    "c16": ((32, 16),),
    "c48": ((96, 48),),
    "bursty": ((4, 1), (48, 48), (4, 1)),  # quiet, a burst of 48 at once, quiet again
}


def workload_file(path: str | None = None) -> dict:
    """The parsed prompts file (``path``, else $SPECPLUGIN_WORKLOAD_PROMPTS, else the shipped one).

    Shape: {"about": str, "recipe": str, "seed": int, "corpora": {corpus: str}, "documents":
    {"<corpus>:<source>": doc_sha256}, "categories": {name: [{"corpus", "source", "offset",
    "excerpt_len", "text"[, "continuation"]}, ...]}}. Cached; do not modify it.
    """
    return _read_json(path or os.environ.get(WORKLOAD_FILE_ENV) or WORKLOAD_FILE)


@lru_cache(maxsize=4)
def _read_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


def category_prompts(name: str, count: int | None = None, *, setting: int = 0, seed: int = 0) -> list[Prompt]:
    """The first ``count`` prompts of category ``name`` (all ``CATEGORIES[name].count`` when None),
    in the file's order, each at its category's temperature for ``setting`` (0: the "T = 0"
    setting, 1: "T = 1"). ``mixed``: :func:`mixed_requests` with ``seed``. Raises ValueError for a
    category without prompts or when ``count`` exceeds them."""
    if name not in CATEGORIES:
        raise KeyError(f"no category {name!r}; there are {', '.join(CATEGORIES)}")
    category = CATEGORIES[name]
    if category.parts:
        return mixed_requests(category.count if count is None else count, seed=seed, setting=setting)
    data = workload_file()
    records = data["categories"].get(name) or []
    if not records:
        raise ValueError(f"the prompts file has no {name!r} prompts")
    if count is not None and count > len(records):
        raise ValueError(f"only {len(records)} {name!r} prompts, asked for {count}")
    temperature = category.temperatures[setting]
    return [
        Prompt(r["text"], name, temperature, r["corpus"], r["source"], r["offset"], r["excerpt_len"],
               data["documents"][f"{r['corpus']}:{r['source']}"], r.get("continuation"))
        for r in records[:count]
    ]


def _rank(*key) -> bytes:
    # Orders by sha256, not random.Random or hash(): the same stream on every Python version and
    # PYTHONHASHSEED, so every machine sends the same requests in the same order.
    return hashlib.sha256("\0".join(map(str, key)).encode()).digest()


def mixed_requests(count: int, seed: int = 0, *, setting: int = 0) -> list[Prompt]:
    """``count`` requests of the four text categories interleaved, deterministic in ``seed``.

    Block b (requests 4b .. 4b + 3) holds one prompt of each category in a seeded order; category c
    contributes its prompts in a seeded permutation, the b-th of it in block b, so no prompt repeats
    until a category's pool is used up (192 requests), after which the same sequence starts again.
    Each request carries its own category's temperature for ``setting`` (0 or 1).
    """
    parts = CATEGORIES["mixed"].parts
    pools = {name: category_prompts(name, setting=setting) for name in parts}
    orders = {name: sorted(range(len(pool)), key=lambda i, n=name: _rank(seed, "pool", n, i))
              for name, pool in pools.items()}
    out: list[Prompt] = []
    block = 0
    while len(out) < count:
        for name in sorted(parts, key=lambda n: _rank(seed, "block", block, n)):
            pool = pools[name]
            out.append(pool[orders[name][block % len(pool)]])
        block += 1
    return out[:count]


def mixed_phases(schedule: str, seed: int = 0, *, setting: int = 0) -> list[tuple[list[Prompt], int]]:
    """The phases of ``MIXED_PHASES[schedule]`` as [(prompts, concurrency), ...], the prompts
    consecutive slices of one :func:`mixed_requests` stream (so phases never share a request).

    ``throughput.bench`` serves every prompt of a workload at one temperature; pass
    ``phase_texts(...)`` to ``run_phases`` / ``benchmark_workload(phases=...)`` for that, or serve
    each request at its own ``Prompt.temperature`` (creative's), which bench does not do yet.
    """
    shape = MIXED_PHASES[schedule]
    stream = mixed_requests(sum(requests for requests, _ in shape), seed, setting=setting)
    phases, start = [], 0
    for requests, concurrency in shape:
        phases.append((stream[start: start + requests], concurrency))
        start += requests
    return phases


def batch1_workloads(per_category: int) -> dict[str, tuple[list[str], list[float]]]:
    """The batch-1 workloads of the baseline and strategy benchmarks: {name: (prompt texts, one
    temperature per prompt)} for ``code``, ``prose``, ``copy``, ``creative`` (``per_category``
    prompts each, setting 0) and ``mixed-T0`` / ``mixed-T1`` (the first ``per_category`` of the
    interleaved mix at concurrency 1, settings 0 and 1: whole blocks of four when it is a multiple of 4)."""
    out = {}
    for name in ("code", "prose", "copy", "creative"):
        prompts = category_prompts(name, per_category, setting=0)
        out[name] = ([p.text for p in prompts], [p.temperature for p in prompts])
    for setting in (0, 1):
        ((prompts, _concurrency),) = mixed_phases("c1", setting=setting)
        prompts = prompts[:per_category]
        out[f"mixed-T{setting}"] = ([p.text for p in prompts], [p.temperature for p in prompts])
    return out


def phase_texts(phases: list[tuple[list[Prompt], int]]) -> list[tuple[list[str], int]]:
    """[(prompts, concurrency)] -> [(prompt texts, concurrency)], what ``bench.run_phases`` takes."""
    return [([p.text for p in prompts], concurrency) for prompts, concurrency in phases]


def read_source(corpus_name: str, source: str) -> str | None:
    """The document ``source`` of corpus "code" or "prose" as on this machine, normalised as that
    corpus module loads it; None when the corpus or the file is absent."""
    from vllm_specplugin.models import corpus, prose

    try:
        root = corpus.stdlib_root() if corpus_name == "code" else prose.prose_root()
        raw = (root / source).read_bytes()
    except OSError:
        return None
    text = raw.decode("utf-8") if corpus_name == "code" else raw.decode("utf-8", errors="replace")
    return text.replace("\r\n", "\n").replace("\r", "\n")


def is_heldout_source(corpus_name: str, source: str) -> bool:
    """Whether ``source`` is a held-out document by its corpus module's own rule (its path is all
    that rule reads, so this needs neither corpus installed) and not a path the module skips."""
    from vllm_specplugin.models import corpus, prose

    parts = source.split("/")
    if corpus_name == "code":
        return source.endswith(".py") and not set(parts[:-1]) & corpus.SKIP_DIRS and corpus.is_heldout(source)
    if corpus_name == "prose":
        return (source.endswith(".rst.txt") and not set(parts[:-1]) & prose.SKIP_DIRS
                and parts[-1] not in prose.SKIP_FILES and prose.is_heldout(source))
    raise ValueError(f"unknown corpus {corpus_name!r}")


def doc_sha256(text: str) -> str:
    """First 16 hex digits of the sha256 of a document's text: which text a prompt was cut from."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# --- the recipe -------------------------------------------------------------------------------

_SENTENCE_END = re.compile(r"[.?!](?=\s|$)")
_ABBREVIATIONS = ("e.g.", "i.e.", "etc.", "vs.", "cf.", "approx.")
_UNDERLINE = re.compile(r"\s*([=\-~^\"'*#+`:.])\1{2,}\s*")  # section adornments, table rules
_FIELD = re.compile(r"\s*:[\w .-]+:(\s|$)")  # field lists (":synopsis: ...")
# Directives whose indented content is code or a table, not prose.
_LITERAL_DIRECTIVES = re.compile(
    r"\s*\.\. (code-block|sourcecode|code|doctest|testcode|testoutput|testsetup|productionlist|literalinclude|"
    r"csv-table|list-table|table|math|raw|parsed-literal|highlight|graphviz)\b")
_DEF = re.compile(r"([ \t]*)(async[ \t]+)?def[ \t]+\w+")


def _paragraphs(text: str) -> list[tuple[int, int]]:
    """(start, end) of each run of non-blank lines; ``end`` is after its last line's newline."""
    spans, start, pos = [], None, 0
    for line in text.splitlines(keepends=True):
        if line.strip():
            start = pos if start is None else start
        elif start is not None:
            spans.append((start, pos))
            start = None
        pos += len(line)
    if start is not None:
        spans.append((start, pos))
    return spans


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _prose_paragraphs(text: str) -> list[tuple[int, int, bool]]:
    """Each paragraph's (start, end, is_prose): running English text, not a heading, directive,
    field list, table, link list, doctest or literal block (reST: a paragraph ending in "::", or a code
    directive, makes the more indented paragraphs after it literal)."""
    out: list[tuple[int, int, bool]] = []
    literal_indent: int | None = None
    for start, end in _paragraphs(text):
        lines = text[start:end].splitlines()
        indent = _indent(lines[0])
        if literal_indent is not None and indent > literal_indent:
            out.append((start, end, False))
            continue
        literal_indent = None
        last = lines[-1].rstrip()
        if (last.endswith("::") and not last.lstrip().startswith("..")) or _LITERAL_DIRECTIVES.match(lines[0]):
            literal_indent = indent
        prose = not any(
            line.lstrip().startswith(("..", ">>>", "...", "|", "+-", "#")) or "://" in line
            or _UNDERLINE.fullmatch(line) or _FIELD.match(line) or _indent(line) < indent
            for line in lines
        )
        body = " ".join(line.strip() for line in lines)
        prose = prose and len(body.split()) >= 8 and sum(c.isalpha() or c == " " for c in body) >= 0.8 * len(body)
        out.append((start, end, prose))
    return out


def _prose_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of every prose paragraph, extended over the next paragraph when that is prose too
    ("a paragraph or two")."""
    paragraphs = _prose_paragraphs(text)
    spans = []
    for k, (start, end, prose) in enumerate(paragraphs):
        if prose:
            if k + 1 < len(paragraphs) and paragraphs[k + 1][2]:
                end = paragraphs[k + 1][1]
            spans.append((start, end))
    return spans


def _sentence_cuts(text: str, start: int, end: int, lo: int, hi: int, line_end_only: bool) -> list[int]:
    """Prompt ends p in (start, end] at a sentence end with ``lo <= p - start <= hi`` and text after
    p. A sentence ending its line takes the newline with it (cut at the line boundary);
    ``line_end_only``: only those."""
    cuts = []
    for match in _SENTENCE_END.finditer(text, start, end):
        if text[max(start, match.start() - 6): match.end()].endswith(_ABBREVIATIONS):
            continue
        p = match.end()
        if p < len(text) and text[p] == "\n":
            p += 1
        elif line_end_only:
            continue
        if lo <= p - start <= hi and text[p:].strip():
            cuts.append(p)
    return cuts


def _def_blocks(text: str) -> list[tuple[int, int, int]]:
    """(start, signature end, end) of each ``def`` block of a source file: from the def line to
    the end of its body (trailing blank lines left out); the signature is the lines up to the one
    that ends in ":"."""
    lines = text.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    blocks = []
    for i, line in enumerate(lines):
        match = _DEF.match(line)
        if not match:
            continue
        indent = len(match.group(1))
        j = i
        while j < len(lines) and j < i + 6 and not lines[j].split("#")[0].rstrip().endswith(":"):
            j += 1
        if j >= len(lines) or j == i + 6:
            continue  # a signature this recipe does not parse
        k = j + 1
        while k < len(lines) and (not lines[k].strip() or _indent(lines[k]) > indent):
            k += 1
        while k > j + 1 and not lines[k - 1].strip():
            k -= 1
        if k > j + 1:
            blocks.append((offsets[i], offsets[j + 1], offsets[k]))
    return blocks


def _overlaps(used: list[tuple[int, int]], start: int, end: int) -> bool:
    return any(start < b and a < end for a, b in used)


def _round_robin(docs: list, candidates: dict, rng: random.Random, count: int, take) -> list:
    """Up to ``count`` picks spread over the documents: one per document per round, documents in a
    seeded order, each document's candidates in a seeded order; ``take(doc, candidate)`` returns a
    pick or None (the candidate does not fit)."""
    order = list(docs)
    rng.shuffle(order)
    queues = {doc: list(candidates[doc]) for doc in order}
    for queue in queues.values():
        rng.shuffle(queue)
    picks: list = []
    while len(picks) < count and any(queues.values()):
        for doc in order:
            while queues[doc] and len(picks) < count:
                pick = take(doc, queues[doc].pop())
                if pick is not None:
                    picks.append(pick)
                    break
    if len(picks) < count:
        raise RuntimeError(f"the held-out documents give only {len(picks)} of {count} prompts")
    return picks


def make_workload_prompts(seed: int = RECIPE_SEED) -> dict:
    """Cut every text category's prompts from held-out documents; the result is the prompts file
    (shape in :func:`workload_file`). Needs the stdlib and the prose corpus (python3.11-doc).

    Deterministic in ``seed`` (and in the corpora's text, which the file records per document):

    * ``code``: :func:`make_heldout_prompts` (``seed``, 48), the prompts ``heldout_prompts.json``
      already holds;
    * ``prose`` / ``creative``: a prose paragraph of a held-out document (with the next one when
      that is prose too), cut at a sentence end chosen at random among those 150-700 characters
      from its start; documents take turns (one prompt each per round); passages never overlap,
      across the two categories and copy's;
    * ``copy``: alternately (a) a prose passage as above but 150-450 characters and cut at a line
      end, then a blank line and its first 25-45 % (cut before a space); (b) a held-out stdlib
      ``def`` block of 150-450 characters whose body is at least as long as its signature, then a
      blank line and the signature again.
    """
    from vllm_specplugin.models import corpus, prose

    code_docs = {f.relpath: f.text for f in corpus.load("heldout")}
    prose_docs = {f.relpath: f.text for f in prose.load("heldout")}
    documents: dict[str, str] = {}
    used: dict[str, list[tuple[int, int]]] = {rel: [] for rel in prose_docs}

    def record(corpus_name: str, rel: str, offset: int, text: str, **extra) -> dict:
        doc = code_docs[rel] if corpus_name == "code" else prose_docs[rel]
        documents[f"{corpus_name}:{rel}"] = doc_sha256(doc)
        return {"corpus": corpus_name, "source": rel, "offset": offset,
                "excerpt_len": extra.pop("excerpt_len", len(text)), "text": text, **extra}

    categories: dict[str, list[dict]] = {"code": []}
    for p in make_heldout_prompts(seed, CATEGORIES["code"].count):
        doc = code_docs[p["source"]]
        start = sum(len(line) for line in doc.splitlines(keepends=True)[: max(0, p["line"] - 1 - 6)])
        categories["code"].append(record("code", p["source"], start, p["prompt"]))

    spans = {rel: _prose_spans(text) for rel, text in prose_docs.items()}

    def prose_taker(rng: random.Random, bounds: tuple[int, int], line_end_only: bool):
        def take(rel: str, span: tuple[int, int]):
            text = prose_docs[rel]
            cuts = [p for p in _sentence_cuts(text, *span, *bounds, line_end_only)
                    if not _overlaps(used[rel], span[0], p)]
            if not cuts:
                return None
            end = rng.choice(cuts)
            used[rel].append((span[0], end))
            return rel, span[0], end
        return take

    for name in ("prose", "creative"):
        rng = random.Random(f"{seed}/{name}")
        picks = _round_robin(sorted(prose_docs), spans, rng, CATEGORIES[name].count,
                             prose_taker(rng, PROMPT_CHARS, False))
        categories[name] = [record("prose", rel, start, prose_docs[rel][start:end]) for rel, start, end in picks]

    half = CATEGORIES["copy"].count // 2
    rng = random.Random(f"{seed}/copy")
    prose_copies = []
    for rel, start, end in _round_robin(sorted(prose_docs), spans, rng, CATEGORIES["copy"].count - half,
                                        prose_taker(rng, COPY_PASSAGE_CHARS, True)):
        passage = prose_docs[rel][start:end]
        lo, hi = (int(f * len(passage)) for f in COPY_HEAD_FRACTION)
        head = rng.choice([i for i in range(lo, hi + 1) if passage[i] == " " and not passage[i - 1].isspace()])
        prose_copies.append(record("prose", rel, start, passage + "\n" + passage[:head],
                                   excerpt_len=len(passage), continuation=passage[head:]))

    def take_def(rel: str, block: tuple[int, int, int]):
        start, signature_end, end = block
        if not COPY_PASSAGE_CHARS[0] <= end - start <= COPY_PASSAGE_CHARS[1]:
            return None
        if end - signature_end < signature_end - start:
            return None  # too little body to repeat
        return rel, block

    blocks = {rel: _def_blocks(text) for rel, text in code_docs.items()}
    code_copies = []
    for rel, (start, signature_end, end) in _round_robin(sorted(code_docs), blocks, rng, half, take_def):
        doc = code_docs[rel]
        code_copies.append(record("code", rel, start, doc[start:end] + "\n" + doc[start:signature_end],
                                  excerpt_len=end - start, continuation=doc[signature_end:end]))
    categories["copy"] = [p for pair in zip(prose_copies, code_copies) for p in pair]

    return {
        "about": ("Held-out prompts of the workload library (throughput/workloads.py, CATEGORIES): "
                  "each cut from a held-out document of models/corpus.py (stdlib code) or models/"
                  "prose.py (the Python documentation's reST sources); 'documents' holds the first 16 "
                  "hex digits of each source document's sha256 (the text the offsets refer to)."),
        "recipe": f"vllm_specplugin.throughput.workloads.make_workload_prompts(seed={seed})",
        "seed": seed,
        "corpora": {"code": "models/corpus.py: the Python {}.{}.{} standard library".format(*sys.version_info[:3]),
                    "prose": "models/prose.py: the Python documentation's reST sources (Debian's python3.11-doc)"},
        "documents": dict(sorted(documents.items())),
        "categories": {name: categories[name] for name in TEXT_CATEGORIES},
    }


# --- CLI --------------------------------------------------------------------------------------

def summary() -> str:
    """A table of the categories and the mixed schedules, from the shipped prompts file."""
    lines = [f"{'category':<9s} {'prompts':>7s} {'T (settings 0, 1)':>17s} {'chars min/median/max':>21s} "
             f"{'documents':>9s}  description"]
    for name, category in CATEGORIES.items():
        prompts = category_prompts(name)
        lengths = sorted(len(p.text) for p in prompts)
        temperatures = ", ".join(f"{t:g}" for t in category.temperatures) if not category.parts else "own"
        lines.append(
            f"{name:<9s} {len(prompts):>7d} {temperatures:>17s} "
            f"{f'{lengths[0]}/{lengths[len(lengths) // 2]}/{lengths[-1]}':>21s} "
            f"{len({(p.corpus, p.source) for p in prompts}):>9d}  {category.description}")
    lines.append("\nmixed schedules (requests x concurrency per phase): " + "; ".join(
        f"{name}: " + " -> ".join(f"{r} x {c}" for r, c in shape) for name, shape in MIXED_PHASES.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_specplugin.throughput.workloads",
        description="The workload library's held-out prompts: print a summary (default), or regenerate "
                    "workload_prompts.json from the corpora (the stdlib and Debian's python3.11-doc).")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", action="store_true", help="regenerate the prompts file (see --out)")
    action.add_argument("--verify", action="store_true",
                        help="regenerate in memory and compare with the shipped file (exit 1 if they differ)")
    parser.add_argument("--seed", type=int, default=RECIPE_SEED, help=f"recipe seed (default {RECIPE_SEED})")
    parser.add_argument("--out", default=WORKLOAD_FILE,
                        help="where --write writes (default: the shipped throughput/workload_prompts.json)")
    args = parser.parse_args(argv)
    if not (args.write or args.verify):
        print(summary())
        return 0
    made = make_workload_prompts(args.seed)
    if args.verify:
        shipped = workload_file()
        same = all(made[key] == shipped.get(key) for key in ("documents", "categories"))
        print("the recipe reproduces the shipped prompts" if same else
              "the recipe's prompts differ from the shipped file (another corpus text or recipe?)")
        return 0 if same else 1
    with open(args.out, "w") as f:
        json.dump(made, f, indent=1, ensure_ascii=False)
        f.write("\n")
    _read_json.cache_clear()
    print(f"wrote {args.out}: " + ", ".join(f"{n} {len(ps)}" for n, ps in made["categories"].items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
