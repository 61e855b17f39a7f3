"""Packaging: one import namespace (issue 11 item 13), and no code importing the old top-level names."""

from __future__ import annotations

import ast
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


def build_wheel(tmp_path: Path) -> Path:
    """The wheel of the working tree, built in ``tmp_path`` (tests/server/test_wheel_install.py uses
    it too). Built from a copy: setuptools reuses a stale build/ dir, which would test an old layout."""
    source = tmp_path / "src"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".venv", "runs", "build", ".git", "*.safetensors", "__pycache__", "*.egg-info"))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path), str(source)],
        check=True, capture_output=True, timeout=300,
    )
    (wheel,) = tmp_path.glob("vllm_specplugin-*.whl")
    return wheel


def test_wheel_installs_only_the_plugin_namespace(tmp_path):
    wheel = build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"vllm_specplugin"}, sorted(top)
    for sub in ("stats", "proposers", "verification", "throughput", "models"):
        assert f"vllm_specplugin/{sub}/__init__.py" in names, sub
    assert "vllm_specplugin/throughput/heldout_prompts.json" in names
    assert not any(n.endswith(".safetensors") for n in names), "checkpoints must not ship in the wheel"


# -- the plugin package stands in layers (issue 32 item 5a) ------------------------------------------

PACKAGE = REPO / "vllm_specplugin"

# The modules of vllm_specplugin/ (the top level, not its subpackages), lowest layer first. A module
# imports only from its own layer or the layers below; the whole graph, own layer included, has no
# cycle. Every import counts, wherever it stands: at module level, inside a function or method, or
# under ``if TYPE_CHECKING`` (a function-level import only defers a circle to run time; it still
# ties the two modules together).
LAYERS = {
    # settings and the mechanisms every piece uses (patches.wrap_once); imports no feature
    "ground": {"version", "logging_utils", "config", "patches", "fault_switch", "paths"},
    # the custom_class proposer adapters and the pieces that patch vLLM, each installable alone
    "pieces": {"adapters", "draft_free_steps", "draft_kernels", "metrics", "runner_shim", "tree_verification",
               "lossy_acceptance", "rejection_methods", "tensor_parallel", "sampler_repair", "generator_repair",
               "compile_cache_repair", "shutdown_repair"},
    # what installs the pieces, injects test faults over them, checks vLLM's internals, or starts vLLM
    "installers": {"__init__", "install", "faults", "compat", "cli", "server"},
}


def _imported_modules(node: ast.AST, package_modules: set[str]) -> set[str]:
    """The vllm_specplugin/*.py modules one import statement names (absolute or relative)."""
    found: set[str] = set()
    if isinstance(node, ast.Import):
        for alias in node.names:
            parts = alias.name.split(".")
            if parts[0] == "vllm_specplugin" and len(parts) > 1 and parts[1] in package_modules:
                found.add(parts[1])
    elif isinstance(node, ast.ImportFrom):
        parts = (node.module or "").split(".") if node.module else []
        if node.level == 0 and parts[:1] == ["vllm_specplugin"]:
            parts = parts[1:]
        elif node.level != 1:
            return found  # another package, or above ours
        if parts:
            if parts[0] in package_modules:
                found.add(parts[0])
        else:  # from vllm_specplugin import x, y  /  from . import x
            found.update(alias.name for alias in node.names if alias.name in package_modules)
    return found


def import_graph(package: Path = PACKAGE) -> dict[str, dict[str, list[int]]]:
    """{module: {imported module: [line, ...]}} over every import statement of package/*.py."""
    modules = {path.stem for path in package.glob("*.py")}
    graph: dict[str, dict[str, list[int]]] = {}
    for module in sorted(modules):
        edges: dict[str, list[int]] = {}
        for node in ast.walk(ast.parse((package / f"{module}.py").read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _imported_modules(node, modules) - {module}:
                    edges.setdefault(target, []).append(node.lineno)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, dict]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_import_graph_helpers_see_function_level_and_relative_imports(tmp_path):
    (tmp_path / "a.py").write_text("from vllm_specplugin import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from vllm_specplugin.c import X\n")
    (tmp_path / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import a\n")
    (tmp_path / "d.py").write_text("import vllm_specplugin.a\nfrom vllm_specplugin.proposers import e\n")
    graph = import_graph(tmp_path)
    assert graph == {"a": {"b": [1]}, "b": {"c": [2]}, "c": {"a": [3]}, "d": {"a": [1]}}
    assert cycles(graph) == [["a", "b", "c"]]


def test_plugin_modules_import_each_other_without_a_cycle():
    graph = import_graph()
    found = cycles(graph)
    detail = []
    for component in found:
        members = set(component)
        detail.append(" <-> ".join(component) + ": " + "; ".join(
            f"{source} -> {target} (line {', '.join(map(str, lines))})"
            for source in component for target, lines in sorted(graph[source].items()) if target in members))
    assert not found, "import cycles in vllm_specplugin/:\n" + "\n".join(detail)


def test_plugin_modules_stand_in_their_declared_layers():
    graph = import_graph()
    layer_of = {module: rank for rank, members in enumerate(LAYERS.values()) for module in members}
    names = list(LAYERS)
    problems = [f"{module}: not placed in LAYERS" for module in sorted(set(graph) - set(layer_of))]
    problems += [f"{module}: in LAYERS but not in vllm_specplugin/" for module in sorted(set(layer_of) - set(graph))]
    problems += [f"{source} ({names[layer_of[source]]}) -> {target} ({names[layer_of[target]]}), line {lines[0]}: "
                 "points up a layer"
                 for source, edges in sorted(graph.items()) if source in layer_of
                 for target, lines in sorted(edges.items()) if layer_of.get(target, -1) > layer_of[source]]
    assert not problems, "vllm_specplugin/ out of its layers:\n" + "\n".join(problems)


# -- product code cites nothing outside the repository -----------------------------------------------

# The code of the folders that ship (as vllm_specplugin.*) and the scripts CI runs (not data files:
# a model card may record where a model was built).
PRODUCT_DIRS = ("vllm_specplugin", "proposers", "stats", "verification", "throughput", "models", "ci")
# A file of another checkout or of a development machine: the shared folder beside the repository,
# or an absolute path under a workspace or home directory. The operating system's own paths
# (/proc, /tmp, /usr/share/..., /dev) are interfaces, not citations, and stay allowed.
OUTSIDE = re.compile(
    r"\.\./+shared\b"
    r"|(?<![\w.:/~-])/(?:work|workspace|home|root|Users|mnt|srv|scratch)/[^\s\"'`)]*"
    r"|file://[^\s\"'`)]*")


def outside_citations(text: str) -> list[str]:
    return [match.group(0) for match in OUTSIDE.finditer(text)]


def test_outside_citation_pattern():
    assert outside_citations("design map: ``../shared/TREE_VERIFICATION.md``")
    assert outside_citations("design map: ``/work/shared/TREE_VERIFICATION.md``")
    assert outside_citations('open("/home/me/notes.md")') and outside_citations("see file:///srv/x")
    assert not outside_citations('open(f"/proc/{pid}/stat") "/v1/completions" --json /tmp/pred.json')
    assert not outside_citations("docs/tree-verification.md https://github.com/vllm-project/vllm/pull/42121")


def test_product_code_cites_no_file_outside_the_repository():
    offenders = []
    for folder in PRODUCT_DIRS:
        for path in sorted((REPO / folder).rglob("*")):
            if path.suffix not in (".py", ".sh") or "__pycache__" in path.parts:
                continue
            for lineno, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                for hit in outside_citations(line):
                    offenders.append(f"{path.relative_to(REPO)}:{lineno}: {hit}")
    assert not offenders, "product code cites files outside the repository (move what it needs into docs/):\n" + \
        "\n".join(offenders)
