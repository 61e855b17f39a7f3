"""The one mechanism every runtime patch of the plugin uses: :func:`wrap_once`.

vLLM runs general plugins in every process, sometimes twice, so each wrapper marks itself and is
never stacked. Ground layer (tests/test_layout.py): imports nothing of the plugin, so every piece
that patches vLLM (``runner_shim``, ``tree_verification``, the repairs, ...) imports it from below;
what installs the pieces is ``install.py``.
"""

from __future__ import annotations

import functools

_MARK = "_specplugin_wrapped"


def wrap_once(owner, name: str, make_wrapper, mark: str = _MARK) -> None:
    """Replace ``owner.name`` by ``make_wrapper(original)``, unless a wrapper carrying ``mark`` is
    already there. Wrappers that may stack on the same method (a repair over the runtime patches,
    a test fault) pass marks of their own."""
    original = getattr(owner, name)
    if getattr(original, mark, False):
        return
    wrapper = functools.wraps(original)(make_wrapper(original))
    setattr(wrapper, mark, True)
    setattr(owner, name, wrapper)
