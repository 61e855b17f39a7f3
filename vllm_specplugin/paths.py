"""Where things are: the source checkout (only when running from one), the demo models, outputs.

* ``CHECKOUT_ROOT``: the repository, when this package runs from a source checkout (an editable
  install, or ``PYTHONPATH``): the folder above the package holds a ``pyproject.toml`` naming
  vllm-specplugin. ``None`` when installed from a wheel. Only tests and repository tools may need it.
* :func:`models_dir`: the demo model families (``demo/``, ``demo-mb/``): ``$SPECPLUGIN_MODELS_DIR``
  if set, else the checkout's ``models/``, else ``./models`` (under the current directory).
  The checkpoints ship with the source checkout, never in the wheel.
* :func:`runs_dir`: outputs of the commands (demo, soak, benchmarks' history): ``./runs/...``
  under the current directory (in a checkout run from its root, as the Makefile does, that is the
  repository's ``runs/``).

Engines and servers run in the caller's current directory, so relative model paths mean what
they mean to the caller; defaults built here are absolute.
"""

from __future__ import annotations

import os
import re

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
MODELS_ENV = "SPECPLUGIN_MODELS_DIR"
_PROJECT_NAME = re.compile(r'^name\s*=\s*["\']vllm[-_.]specplugin["\']\s*$', re.M | re.I)


def find_checkout(package_dir: str = PACKAGE_DIR) -> str | None:
    """The source checkout that ``package_dir`` belongs to, or None (a wheel install)."""
    root = os.path.dirname(package_dir)
    try:
        with open(os.path.join(root, "pyproject.toml")) as f:
            text = f.read()
    except OSError:
        return None
    return root if _PROJECT_NAME.search(text) else None


CHECKOUT_ROOT: str | None = find_checkout()


def models_dir() -> str:
    """The folder holding the demo model families (absolute; it may not exist: see :func:`require_demo_models`)."""
    if os.environ.get(MODELS_ENV):
        return os.path.abspath(os.environ[MODELS_ENV])
    if CHECKOUT_ROOT is not None:
        return os.path.join(CHECKOUT_ROOT, "models")
    return os.path.abspath("models")


def demo_model(*parts: str) -> str:
    """A demo checkpoint, e.g. ``demo_model("demo", "target")`` (absolute; not checked)."""
    return os.path.join(models_dir(), *parts)


def runs_dir(*parts: str) -> str:
    """Where a command writes its outputs by default: ``./runs/<parts>`` (absolute)."""
    return os.path.abspath(os.path.join("runs", *parts))


class ModelsMissing(SystemExit):
    """A model folder a command needs is not there. A ``SystemExit``: a command that meets it stops
    with this message (exit status 1) instead of a traceback from deep inside vLLM."""


def require_demo_models(*paths: str) -> None:
    """Stop with :class:`ModelsMissing` when one of ``paths`` lies in :func:`models_dir` and is not a
    model folder (no ``config.json``). Other paths (the user's own, relative ones, hub names) are
    left to the plugin and vLLM, which report them."""
    root = models_dir()
    missing = [p for p in paths if isinstance(p, str) and os.path.isabs(p) and _within(p, root)
               and not os.path.isfile(os.path.join(p, "config.json"))]
    if not missing:
        return
    raise ModelsMissing(
        "demo model folder(s) not found: " + ", ".join(missing) + ".\n"
        "The demo models (demo/, demo-mb/) ship in the source checkout's models/ folder, not in the wheel. "
        f"Run from a checkout (`make models` rebuilds them there), or set {MODELS_ENV} to a folder holding "
        f"demo/ and demo-mb/ (looked in: {root}), or pass your own model paths.")


def _within(path: str, root: str) -> bool:
    return os.path.commonpath([os.path.abspath(path), root]) == root
