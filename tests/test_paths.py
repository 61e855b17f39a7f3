"""vllm_specplugin/paths.py (issue 32 item 1): the checkout only when running from one, the demo
models ($SPECPLUGIN_MODELS_DIR, the checkout's models/, ./models), outputs under ./runs, a clear
stop when a demo model is missing, and engines started in the caller's current directory.
tests/server/test_wheel_install.py runs the same from an installed wheel."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_specplugin import paths, server
from vllm_specplugin.verification import drivers

REPO = Path(__file__).resolve().parents[1]


def test_checkout_is_found_only_beside_a_pyproject_naming_the_project(tmp_path):
    assert paths.CHECKOUT_ROOT == str(REPO)
    package = tmp_path / "site-packages" / "vllm_specplugin"
    package.mkdir(parents=True)
    assert paths.find_checkout(str(package)) is None  # a wheel install: no pyproject.toml
    (package.parent / "pyproject.toml").write_text('[project]\nname = "something-else"\n')
    assert paths.find_checkout(str(package)) is None
    (package.parent / "pyproject.toml").write_text('[project]\nname = "vllm-specplugin"\nversion = "0.1.0"\n')
    assert paths.find_checkout(str(package)) == str(package.parent)


def test_models_and_outputs(tmp_path, monkeypatch):
    monkeypatch.delenv(paths.MODELS_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert paths.models_dir() == str(REPO / "models")
    assert paths.runs_dir("soak") == str(tmp_path / "runs" / "soak")  # the current directory, not the checkout
    monkeypatch.setattr(paths, "CHECKOUT_ROOT", None)  # as installed from a wheel
    assert paths.models_dir() == str(tmp_path / "models")
    monkeypatch.setenv(paths.MODELS_ENV, "elsewhere")
    assert paths.models_dir() == str(tmp_path / "elsewhere")
    assert paths.demo_model("demo", "target") == str(tmp_path / "elsewhere" / "demo" / "target")


def test_a_missing_demo_model_stops_with_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv(paths.MODELS_ENV, str(tmp_path / "models"))
    # not a demo model: the user's own paths, relative ones, hub names are left to vLLM and the plugin
    paths.require_demo_models(str(tmp_path / "elsewhere"), "relative/model", "org/hub-name", None)
    target = tmp_path / "models" / "demo" / "target"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    paths.require_demo_models(paths.demo_model("demo", "target"))
    with pytest.raises(SystemExit) as info:
        paths.require_demo_models(paths.demo_model("demo", "target"), paths.demo_model("demo", "draft-distill"))
    message = str(info.value)
    assert message.splitlines()[0] == f"demo model folder(s) not found: {tmp_path / 'models' / 'demo' / 'draft-distill'}."
    assert paths.MODELS_ENV in message and "checkout" in message


class _Refused(Exception):
    pass


def _record_popen(monkeypatch, module, seen: list) -> None:
    def popen(args, **kwargs):
        seen.append(kwargs)
        raise _Refused

    monkeypatch.setattr(module.subprocess, "Popen", popen)


def test_engines_start_in_the_callers_directory(tmp_path, monkeypatch):
    seen: list[dict] = []
    _record_popen(monkeypatch, server, seen)
    with pytest.raises(_Refused):
        with server.VllmServer("relative/target", log_path=str(tmp_path / "log")):
            pass
    _record_popen(monkeypatch, drivers, seen)
    with pytest.raises(_Refused):
        drivers.run_offline("relative/target", [], log_path=str(tmp_path / "log"))
    assert len(seen) == 2 and all(kwargs.get("cwd") is None for kwargs in seen), seen


def test_server_refuses_a_missing_demo_model_before_starting(tmp_path, monkeypatch):
    monkeypatch.setenv(paths.MODELS_ENV, str(tmp_path))
    seen: list[dict] = []
    _record_popen(monkeypatch, server, seen)
    spec = {"method": "custom_class", "model": "vllm_specplugin.adapters.MultiDraftProposer", "num_speculative_tokens": 3}
    with pytest.raises(paths.ModelsMissing):
        with server.VllmServer(paths.demo_model("demo", "target"), speculative_config=spec,
                               log_path=str(tmp_path / "log")):
            pass
    assert not seen  # no process started


# Packages installed with the wheel whose modules must not place data beside their own file (in a
# wheel that is site-packages): demo models come from paths.models_dir(), outputs from runs_dir().
INSTALLED_PACKAGES = ("vllm_specplugin", "models", "proposers", "stats", "verification", "throughput")


def test_no_installed_module_derives_a_data_path_from_its_own_file():
    """Only paths.py may look at its own location (to find a checkout); a module that builds a
    data or output path from ``__file__`` writes into site-packages when installed from a wheel.
    Read-only files shipped inside the package (e.g. throughput's prompt files, package data in
    pyproject.toml) are allowed where the path stays inside the package folder."""
    # package data: the prompt files, and the folder transformers loads custom_generate code from
    shipped = {"throughput/workloads.py", "proposers/hf_generate.py"}
    offenders = []
    for package in INSTALLED_PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            rel = str(path.relative_to(REPO))
            if rel == "vllm_specplugin/paths.py" or rel in shipped:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if "__file__" in line and not line.lstrip().startswith("#"):
                    offenders.append(f"{rel}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
