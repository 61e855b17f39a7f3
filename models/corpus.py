"""Training corpus: the Python standard library's own source code.

It is on every machine that runs the project, needs no download and is
real, varied code.  Choices (all deterministic, no randomness involved):

* root: ``sysconfig.get_paths()["stdlib"]`` of the running interpreter;
  ``*.py`` files only, sorted by relative path.
* skipped: ``site-packages`` / ``dist-packages`` (third-party code, differs
  per machine), test directories (``test``, ``tests``, ``idle_test``: half
  the stdlib by bytes, mostly repetitive asserts, and they would dominate
  held-out prompts), ``encodings`` (generated codec tables), files over ``MAX_FILE_BYTES`` (generated tables and
  doc dumps such as ``pydoc_data/topics.py``) and files that are not UTF-8.
* split: by file, held-out iff ``sha256(relpath) % 10000 < 500`` (~5 %), so
  the split never changes when a file is added or removed elsewhere.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

MAX_FILE_BYTES = 200_000
HELDOUT_PER_10K = 500  # 5 %
SKIP_DIRS = {
    "site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__",
    "encodings",  # ~100 generated codec tables: trivially predictable, would inflate scores
}


@dataclass(frozen=True)
class SourceFile:
    relpath: str  # posix path relative to the stdlib root
    text: str

    @property
    def heldout(self) -> bool:
        return is_heldout(self.relpath)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relpath: str) -> bool:
    h = int.from_bytes(hashlib.sha256(relpath.encode()).digest()[:8], "big")
    return h % 10_000 < HELDOUT_PER_10K


def iter_paths(root: Path | None = None) -> list[str]:
    """Sorted relative paths of the corpus files (filters applied, not read)."""
    root = root or stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for fn in filenames:
            if not fn.endswith(".py"):
                continue
            p = Path(dirpath) / fn
            if p.is_symlink() or p.stat().st_size > MAX_FILE_BYTES:
                continue
            out.append(p.relative_to(root).as_posix())
    return sorted(out)


def load(split: str | None = None, root: Path | None = None) -> list[SourceFile]:
    """Read the corpus; ``split`` is ``"train"``, ``"heldout"`` or None (both)."""
    root = root or stdlib_root()
    files = []
    for rel in iter_paths(root):
        held = is_heldout(rel)
        if split == "train" and held or split == "heldout" and not held:
            continue
        try:
            text = (root / rel).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        # Normalise line endings so the corpus is the same on every OS.
        text = text.replace("\r\n", "\n").replace("\r", "\n")
        if text.strip():
            files.append(SourceFile(rel, text))
    return files


def fingerprint(files: list[SourceFile]) -> str:
    """Short hash of the exact corpus contents (recorded in the model card)."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.relpath.encode() + b"\0" + f.text.encode() + b"\0")
    return h.hexdigest()[:16]
