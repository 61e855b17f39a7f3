"""Serving needs only what serving imports (issue 32 item 5): the plugin's serve path, i.e. the
``vllm.general_plugins`` entry point (``vllm_specplugin.register``), the ``custom_class`` adapters
and every module of ``vllm_specplugin/`` and ``vllm_specplugin.proposers`` they may load, imports
none of matplotlib, scipy and tqdm, which pyproject.toml keeps in the ``verify`` and ``bench``
extras.

vLLM itself imports scipy and tqdm, so the check cannot be "not in sys.modules": a subprocess
records every import statement that a ``vllm_specplugin`` module executes (``builtins.__import__``),
whether or not the module was loaded already.
"""

from __future__ import annotations

import json
import subprocess
import sys

EXTRAS_ONLY = ("matplotlib", "scipy", "tqdm")

SCRIPT = """
import builtins, importlib, json, pkgutil, sys
EXTRAS_ONLY = %r
seen = []
_import = builtins.__import__

def recording_import(name, globals=None, locals=None, fromlist=(), level=0):
    importer = (globals or {}).get("__name__") or ""
    if level == 0 and name.split(".")[0] in EXTRAS_ONLY and importer.split(".")[0] == "vllm_specplugin":
        seen.append(importer + " imports " + name)
    return _import(name, globals, locals, fromlist, level)

builtins.__import__ = recording_import
import vllm_specplugin
vllm_specplugin.register()  # what vLLM runs in every process
import vllm_specplugin.adapters
import vllm_specplugin.proposers
# what the adapters load when vLLM builds the proposer, and the rest of the plugin package
for package, skip in ((vllm_specplugin, {"proposers", "stats", "verification", "throughput", "models"}),
                      (vllm_specplugin.proposers, set())):
    for info in pkgutil.iter_modules(package.__path__):
        if info.name not in skip:
            importlib.import_module(package.__name__ + "." + info.name)
loaded = sorted(m for m in sys.modules if m.split(".")[:2] in (["vllm_specplugin", "verification"],
                                                                 ["vllm_specplugin", "throughput"]))
print("SERVE_IMPORTS " + json.dumps({"seen": seen, "loaded": loaded}))
""" % (EXTRAS_ONLY,)


def test_serve_path_imports_no_verify_or_bench_dependency():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
    line = next((x for x in out.stdout.splitlines() if x.startswith("SERVE_IMPORTS ")), None)
    assert out.returncode == 0 and line, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads(line.split(" ", 1)[1])
    assert not result["seen"], "the serve path imports an extra's dependency:\n" + "\n".join(result["seen"])
    assert not result["loaded"], f"the serve path loads the harness: {result['loaded']}"
