"""The statistics and verification modules cite tests for their calibration claims: every cited
test file must exist and every cited test function must be defined somewhere under tests/."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "stats").glob("*.py")) + sorted((ROOT / "verification").glob("*.py"))


def test_cited_test_files_and_functions_exist():
    defined = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        defined.update(re.findall(r"^def (test_\w+)", path.read_text(), flags=re.M))
    cited_files, cited_tests = [], []
    for source in SOURCES:
        text = source.read_text()
        cited_files += [(source.name, f) for f in re.findall(r"\btests/[\w/]+\.py\b", text)]
        cited_tests += [(source.name, t) for t in re.findall(r"``(test_\w+)``", text)]
    assert cited_files, "no citation found: the scan is broken"
    missing = [(s, f) for s, f in cited_files if not (ROOT / f).exists()]
    assert not missing, missing
    assert not [(s, t) for s, t in cited_tests if t not in defined]
