"""Package metadata (issue 32 item 1): one version, an Apache-2.0 licence, project URLs."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _literal_version() -> str:
    """``__version__`` as written in vllm_specplugin/__init__.py (read, not imported)."""
    tree = ast.parse((ROOT / "vllm_specplugin" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError("vllm_specplugin/__init__.py defines no __version__")


def test_version_agrees_with_pyproject():
    import vllm_specplugin

    version = _pyproject()["project"]["version"]
    assert _literal_version() == version
    assert vllm_specplugin.__version__ == version


def test_licence_is_apache_2():
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License")
    assert "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert _pyproject()["project"]["license"] in ({"text": "Apache-2.0"}, "Apache-2.0")


def test_project_urls():
    urls = _pyproject()["project"]["urls"]
    assert {"Homepage", "Documentation", "Issues"} <= set(urls)
    assert all(u.startswith("https://") for u in urls.values())
