"""The package installed from its wheel, run outside the checkout (issue 32 item 1).

The wheel of the working tree goes into a fresh venv in a temporary folder (``--no-deps``; the
heavy dependencies, vLLM and torch among them, come from this checkout's venv through a ``.pth``
file, so nothing is downloaded). Then, from a working folder outside the repository that holds a
copy of the small demo family (``demo/target``, ``demo/draft-distill``):

(a) ``specplugin-verify`` (the venv's console script) checks the plugin's proposer on the target
    named by a relative path, the draft too, and writes its report where ``--json`` says;
(b) the venv's ``specplugin-vllm serve``, started by ``VllmServer`` as the soak and the benchmarks
    start it, serves the relative target with the plugin and a relative draft, and answers a
    completion with drafts;
(c) meanwhile neither venv's site-packages gains or changes a file (bytecode caches aside); the
    outputs are in the working folder;
(d) without the demo models, the soak and the demo stop at once with a message that names what is
    missing and how to get it (no traceback).

One engine each for (a) and (b): about 2 minutes each on a quiet 2-core machine; at load average
15 (5 Dec) (a) took 11 minutes and (b)'s server over 15 to start.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import urllib.request
from pathlib import Path

import pytest

from test_layout import build_wheel  # tests/test_layout.py (pytest rootdir import)
from vllm_specplugin.paths import CHECKOUT_ROOT
from vllm_specplugin.server import VllmServer, metric_total

pytestmark = pytest.mark.server

DEMO = Path(CHECKOUT_ROOT, "models", "demo")
SPEC = {"method": "custom_class", "model": "vllm_specplugin.adapters.MultiDraftProposer", "num_speculative_tokens": 3}
PLUGIN = {"specplugin": {"drafts": ["demo/draft-distill"]}}


def site_files(site: str) -> dict[str, int]:
    """Every file under ``site`` (bytecode caches aside) with its modification time."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(site):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for name in filenames:
            path = os.path.join(dirpath, name)
            try:
                found[path] = os.stat(path).st_mtime_ns
            except OSError:
                pass
    return found


def changes(before: dict[str, int], after: dict[str, int]) -> list[str]:
    return sorted([f"new {p}" for p in after.keys() - before.keys()]
                  + [f"changed {p}" for p in after.keys() & before.keys() if after[p] != before[p]])


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv, its site-packages, the environment that runs its commands)."""
    tmp = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(tmp)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # The dependencies: this venv's site-packages, after the new venv's own (so the wheel's
    # vllm_specplugin wins over the checkout's editable install, whose finder .pth is not read there).
    deps = sorted({sysconfig.get_path("purelib"), sysconfig.get_path("platlib")})
    Path(site, "_specplugin_test_deps.pth").write_text("\n".join(deps) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], check=True, capture_output=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "SPECPLUGIN_MODELS_DIR")}
    env.update(PATH=f"{venv / 'bin'}:{env.get('PATH', '')}", VIRTUAL_ENV=str(venv), PYTHONDONTWRITEBYTECODE="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"))
    where = subprocess.run([str(python), "-c", "import vllm_specplugin; print(vllm_specplugin.__file__)"],
                           cwd=tmp, env=env, check=True, capture_output=True, text=True, timeout=300).stdout.strip()
    assert Path(where).is_relative_to(venv), f"the wheel's copy must be the one imported, got {where}"
    return venv, site, env


@pytest.fixture
def workdir(tmp_path):
    """A working folder outside the repository with the small demo target and one draft."""
    assert not tmp_path.is_relative_to(CHECKOUT_ROOT)
    for name in ("target", "draft-distill"):
        shutil.copytree(DEMO / name, tmp_path / "demo" / name)
    return tmp_path


@contextlib.contextmanager
def nothing_written_into_site_packages(site: str):
    """(c) Neither the wheel's venv nor this checkout's venv gains or changes a file meanwhile."""
    sites = (site, sysconfig.get_path("purelib"))
    before = {s: site_files(s) for s in sites}
    yield
    written = [c for s in sites for c in changes(before[s], site_files(s))]
    assert not written, "written into site-packages:\n" + "\n".join(written[:20])


def test_verify_runs_outside_the_checkout(installed, workdir):
    """(a) specplugin-verify on relative model and draft paths, smallest settings."""
    venv, site, env = installed
    with nothing_written_into_site_packages(site):
        verify = subprocess.run(
            [str(venv / "bin" / "specplugin-verify"), "--model", "demo/target", "--temperature", "1.0",
             "--samples", "64", "--tokens", "1", "--random-prompts", "1", "--speculative-config", json.dumps(SPEC),
             "--additional-config", json.dumps(PLUGIN), "--json", "report.json"],
            cwd=workdir, env=env, capture_output=True, text=True, timeout=1500)
    log = verify.stdout[-3000:] + verify.stderr[-3000:]
    # exit 1 is also a statistical FAIL (probability alpha = 0.01); a crash writes no report
    assert verify.returncode in (0, 1) and (workdir / "report.json").exists(), log
    report = json.loads((workdir / "report.json").read_text())
    assert report["model"] == "demo/target" and report["cases"], report


def test_server_runs_outside_the_checkout(installed, workdir, monkeypatch):
    """(b) the venv's specplugin-vllm serves the relative target with the plugin and a relative draft,
    started as the soak and the benchmarks start it (VllmServer: in the caller's directory)."""
    venv, site, env = installed
    monkeypatch.chdir(workdir)
    server = VllmServer("demo/target", speculative_config=SPEC, additional_config=PLUGIN, extra_env=env,
                        log_path="server.log", startup_timeout_s=1500)
    assert server.args[1:3] == ["-m", "vllm_specplugin.cli"]  # = the specplugin-vllm script
    server.args = [str(venv / "bin" / "specplugin-vllm"), *server.args[3:]]
    with nothing_written_into_site_packages(site), server:
        request = urllib.request.Request(
            server.base_url + "/v1/completions", headers={"Content-Type": "application/json"},
            data=json.dumps({"model": "demo/target", "prompt": "def add(a, b):", "max_tokens": 8,
                             "temperature": 0}).encode())
        with urllib.request.urlopen(request, timeout=600) as response:
            body = json.load(response)
        drafts = metric_total(server.settled_metrics("vllm:spec_decode"), "vllm:spec_decode_num_draft_tokens_total")
    assert body["usage"]["completion_tokens"] == 8 and drafts > 0, (body, drafts)
    assert "drafts ['demo/draft-distill']" in server.log_tail(chars=10**7)  # the relative draft, as given
    assert (workdir / "server.log").exists()


def test_demo_commands_name_the_missing_models(installed, tmp_path):
    """(d) No checkout, no SPECPLUGIN_MODELS_DIR, no ./models: the soak and the demo say what is missing."""
    venv, _, env = installed
    for module in ("vllm_specplugin.throughput.soak", "vllm_specplugin.throughput.demo"):
        out = subprocess.run([str(venv / "bin" / "python"), "-m", module], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=300)
        message = out.stdout + out.stderr
        assert out.returncode != 0, message
        assert "Traceback" not in message and "SPECPLUGIN_MODELS_DIR" in message, message
        assert str(tmp_path / "models") in message, message
