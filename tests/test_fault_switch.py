"""Fault injection is opt-in by construction (issue 32 item 2): no fault variable is read unless the
testing switch holds its exact phrase; a set variable without it is ignored, with a warning."""

from __future__ import annotations

import ast
import os
import pathlib

import pytest

from vllm_specplugin import fault_switch, faults, tree_verification
from vllm_specplugin.paths import CHECKOUT_ROOT as REPO_ROOT

PRODUCT = [pathlib.Path(REPO_ROOT, d) for d in ("vllm_specplugin", "proposers", "stats", "verification", "throughput")]


def test_fault_variables_are_ignored_without_the_switch(monkeypatch, caplog):
    monkeypatch.delenv(fault_switch.SWITCH_ENV, raising=False)
    monkeypatch.setenv("SPECPLUGIN_TREE_FAULT", "no_kv_compaction")
    monkeypatch.setenv("SPECPLUGIN_INJECT_FAULT", "resample_from_p")
    monkeypatch.setenv("SPECPLUGIN_DRAFT_FAULT", "raise:0.5")
    assert tree_verification.requested_fault() is None
    assert faults.requested_fault() is None
    assert faults.draft_faults() is None
    monkeypatch.setenv(fault_switch.SWITCH_ENV, "1")  # anything but the phrase is off
    assert tree_verification.requested_fault() is None


def test_fault_variables_act_with_the_switch(monkeypatch):
    monkeypatch.setenv(fault_switch.SWITCH_ENV, fault_switch.SWITCH_VALUE)
    monkeypatch.setenv("SPECPLUGIN_TREE_FAULT", "no_kv_compaction")
    monkeypatch.setenv("SPECPLUGIN_INJECT_FAULT", "resample_from_p")
    assert tree_verification.requested_fault() == "no_kv_compaction"
    assert faults.requested_fault() == "resample_from_p"


def test_the_suite_runs_with_the_switch_on():
    assert os.environ.get(fault_switch.SWITCH_ENV) == fault_switch.SWITCH_VALUE  # tests/conftest.py


def test_no_product_code_reads_a_fault_variable_directly():
    """Every read of a SPECPLUGIN_*_FAULT variable goes through fault_switch.fault_variable: no
    os.environ / os.getenv call in product code names one (by literal or by a *FAULT* constant)."""
    offenders, reads = [], 0
    for root in PRODUCT:
        for path in root.rglob("*.py"):
            if path.name == "fault_switch.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Call):
                    continue
                func = ast.unparse(node.func)
                if func in ("os.environ.get", "os.getenv", "environ.get") and node.args:
                    reads += 1
                    arg = ast.unparse(node.args[0])
                    if "FAULT" in arg.upper():
                        offenders.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno}: {func}({arg})")
    assert reads >= 5, "the scan found (almost) no environment reads: it is broken"
    assert not offenders, offenders


@pytest.mark.parametrize("name", ["SPECPLUGIN_TREE_FAULTS", "PATH"])
def test_only_known_fault_variables(name):
    with pytest.raises(ValueError, match="not a fault variable"):
        fault_switch.fault_variable(name)
