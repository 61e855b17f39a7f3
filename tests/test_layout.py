"""Packaging: one import namespace (issue 11 item 13), and no code importing the old top-level names."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OLD_TOP_LEVEL = re.compile(r"^\s*(from|import)\s+(stats|proposers|verification|throughput)\b", re.M)


def test_no_module_imports_a_bare_top_level_package():
    offenders = []
    for path in REPO.rglob("*.py"):
        if {".venv", "runs", "build"} & set(path.parts):
            continue
        for match in OLD_TOP_LEVEL.finditer(path.read_text()):
            offenders.append(f"{path.relative_to(REPO)}: {match.group(0).strip()}")
    assert not offenders, "import these through vllm_specplugin.*: " + "; ".join(offenders)


def test_wheel_installs_only_the_plugin_namespace(tmp_path):
    # Build from a copy: setuptools reuses a stale build/ dir, which would test an old layout.
    source = tmp_path / "src"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".venv", "runs", "build", ".git", "*.safetensors", "__pycache__", "*.egg-info"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(source)],
        check=True, capture_output=True, timeout=300,
    )
    (wheel,) = tmp_path.glob("vllm_specplugin-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"vllm_specplugin"}, sorted(top)
    for sub in ("stats", "proposers", "verification", "throughput", "models"):
        assert f"vllm_specplugin/{sub}/__init__.py" in names, sub
    assert "vllm_specplugin/throughput/heldout_prompts.json" in names
    assert not any(n.endswith(".safetensors") for n in names), "checkpoints must not ship in the wheel"
