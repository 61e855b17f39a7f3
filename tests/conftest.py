"""Shared fixtures: small peaked Llama checkpoints made once per test session."""

from __future__ import annotations

import pytest

from verification.checkpoints import make_random_llama


@pytest.fixture(scope="session")
def random_target(tmp_path_factory) -> str:
    """2-layer, 128-wide float32 Llama over a 512-token vocabulary, peaked next-token distributions."""
    return str(make_random_llama(tmp_path_factory.mktemp("models") / "target", seed=0))


@pytest.fixture(scope="session")
def random_draft(tmp_path_factory) -> str:
    """1-layer draft with the target's vocabulary and different weights."""
    return str(
        make_random_llama(
            tmp_path_factory.mktemp("models") / "draft", num_layers=1, logit_scale=3.0, seed=1
        )
    )
