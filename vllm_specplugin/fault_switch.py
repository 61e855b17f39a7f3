"""The one gate in front of every fault-injection variable (tests only).

The plugin's fault hooks (``SPECPLUGIN_INJECT_FAULT``, ``SPECPLUGIN_DRAFT_FAULT``,
``SPECPLUGIN_TREE_FAULT``, ``SPECPLUGIN_TP_FAULT``) break exactness or robustness on purpose, so
that tests can show they are caught. A deployment must never run one because a variable leaked
into its environment: a fault variable is read only when the testing switch
``SPECPLUGIN_TESTING_FAULTS`` holds the exact phrase :data:`SWITCH_VALUE`, which nobody sets by
accident. Without it a set fault variable is ignored, with a loud warning. The test suite turns the
switch on in ``tests/conftest.py``; ``verification.check.run_check(injected_fault=...)`` turns it on for the
engine it starts (a deliberate request).

Ground layer: imports nothing of the plugin but its logger.
"""

from __future__ import annotations

import os

from vllm_specplugin.logging_utils import log_once

SWITCH_ENV = "SPECPLUGIN_TESTING_FAULTS"
SWITCH_VALUE = "inject-faults-that-break-exactness"
FAULT_VARIABLES = ("SPECPLUGIN_INJECT_FAULT", "SPECPLUGIN_DRAFT_FAULT", "SPECPLUGIN_TREE_FAULT",
                   "SPECPLUGIN_TP_FAULT")


def faults_enabled() -> bool:
    return os.environ.get(SWITCH_ENV, "") == SWITCH_VALUE


def switch_env() -> dict[str, str]:
    """The environment entry that turns fault injection on (for a test's or the verifier's engine)."""
    return {SWITCH_ENV: SWITCH_VALUE}


def fault_variable(name: str) -> str:
    """The value of fault variable ``name`` (stripped), or "" when it is unset or the switch is off."""
    if name not in FAULT_VARIABLES:
        raise ValueError(f"{name} is not a fault variable ({', '.join(FAULT_VARIABLES)})")
    value = os.environ.get(name, "").strip()
    if value and not faults_enabled():
        log_once("warning", f"specplugin: {name}={value!r} is set but IGNORED: fault injection needs the "
                            f"testing switch {SWITCH_ENV} (tests only; see docs/reliability.md)")
        return ""
    return value
