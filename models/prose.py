"""Prose corpus: the Python documentation's English text (reStructuredText sources).

Where it comes from: Debian's ``python3.11-doc`` package (bookworm, 3.11.2-6+deb12u8 when this
family was built) installs the HTML documentation together with its Sphinx sources,
``/usr/share/doc/python3.11/html/_sources/**/*.rst.txt`` (about 11 MB of English prose with light
reST markup: roles such as ``:func:`x```, directives, indented examples). Every machine of this
project reaches Debian's registry, so ``apt-get install python3.11-doc`` reproduces it; another root
can be given with ``SPECPLUGIN_PROSE_ROOT``. Licence: the Python documentation is distributed under
the PSF License Agreement (its code examples under the Zero-Clause BSD licence); see
``license.rst.txt`` in the same tree.

Choices (deterministic, like ``models/corpus.py``):

* files: ``*.rst.txt``, sorted by relative path; skipped: ``whatsnew/`` (release notes: mostly
  lists of issue numbers, 1.7 MB), ``includes/`` (fragments), ``license.rst.txt`` and
  ``copyright.rst.txt`` (legal text, not documentation);
* split: by document, held out iff ``sha256("prose/" + relpath) % 10000 < 1000`` (~10 %: there are
  far fewer documents than stdlib files, and each held-out document yields several prompts).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from dataclasses import dataclass

DEBIAN_ROOT = Path("/usr/share/doc/python3.11/html/_sources")
HELDOUT_PER_10K = 1000
SKIP_DIRS = {"whatsnew", "includes"}
SKIP_FILES = {"license.rst.txt", "copyright.rst.txt"}


@dataclass(frozen=True)
class ProseFile:
    relpath: str  # posix path relative to the prose root
    text: str
    heldout: bool


INSTALL_HINT = ("the prose corpus is the Python documentation's sources from Debian's python3.11-doc: "
                "install it with `apt-get install python3.11-doc`, or point SPECPLUGIN_PROSE_ROOT at a "
                "folder of *.rst.txt files")


def prose_root() -> Path:
    return Path(os.environ.get("SPECPLUGIN_PROSE_ROOT", DEBIAN_ROOT))


def is_heldout(relpath: str) -> bool:
    h = int.from_bytes(hashlib.sha256(("prose/" + relpath).encode()).digest()[:8], "big")
    return h % 10_000 < HELDOUT_PER_10K


def iter_paths(root: Path | None = None) -> list[str]:
    """Sorted relative paths of the prose documents (filters applied, not read)."""
    root = root or prose_root()
    if not root.is_dir():
        raise FileNotFoundError(f"{root} does not exist: {INSTALL_HINT}")
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for fn in filenames:
            if fn.endswith(".rst.txt") and fn not in SKIP_FILES:
                out.append((Path(dirpath) / fn).relative_to(root).as_posix())
    if not out:
        raise FileNotFoundError(f"no *.rst.txt under {root}: {INSTALL_HINT}")
    return sorted(out)


def load(split: str | None = None, root: Path | None = None) -> list[ProseFile]:
    """Read the prose corpus; ``split`` is ``"train"``, ``"heldout"`` or None (both)."""
    root = root or prose_root()
    files = []
    for rel in iter_paths(root):
        held = is_heldout(rel)
        if split == "train" and held or split == "heldout" and not held:
            continue
        text = (root / rel).read_bytes().decode("utf-8", errors="replace")
        text = text.replace("\r\n", "\n").replace("\r", "\n")
        if text.strip():
            files.append(ProseFile(rel, text, held))
    return files

