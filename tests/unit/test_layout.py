"""The package map docs/architecture.md draws: packages are processes, and imports only
run down the layers (the CLI on top; the shared config, protocol and helpers at the bottom)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "hybridlb"
BASE = {"config", "protocol", "params", "prefix_hash", "transport", "netaddr", "cpu_features", "lifecycle", "plan",
        "__init__"}
# What each part may import besides itself and BASE (a package, or a top-level module).
ALLOWED = {
    "checkpoint": set(),
    "kernels": set(),
    "grammar": {"checkpoint"},
    "model": {"checkpoint", "kernels"},
    "engine": {"model", "kernels", "checkpoint", "grammar"},
    "coordinator": set(),
    # The API server in layers: its shell (app, http_server, guard) over the OpenAI surface over
    # the node's dispatcher, with its errors and its launcher's spec under all three.
    "api": {"checkpoint", "grammar", "api.openai", "api.dispatch", "api.errors", "api.spec"},
    "api.openai": {"checkpoint", "grammar", "api.dispatch", "api.errors", "api.spec"},
    "api.dispatch": {"checkpoint", "api.errors"},
    "api.errors": set(),
    "api.spec": set(),
    "bench": {"checkpoint"},
    "llm": {"engine", "checkpoint", "grammar"},
    "launch": {"api", "api.spec", "engine", "coordinator", "checkpoint"},
    "cli": {"checkpoint", "grammar", "model", "engine", "coordinator", "api", "api.openai", "api.dispatch",
            "api.errors", "api.spec", "bench", "llm", "launch"},
    # the harness tests and benchmarks share; no server imports it
    "testing": {"checkpoint", "model"},
}


API_LAYERS = {"openai", "dispatch", "errors", "spec"}


def _part(module: str) -> str:
    """The part a dotted module name belongs to: its package under hybridlb, or its own name
    (the API server's layers, ``API_LAYERS``, are parts of their own)."""
    names = module.split(".")
    if names[1:2] == ["api"] and len(names) > 2 and names[2] in API_LAYERS:
        return f"api.{names[2]}"
    return names[1] if len(names) > 1 else "__init__"


def _imports(path: Path) -> set[str]:
    """Every hybridlb module ``path`` imports, anywhere in the file (functions included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("hybridlb"))
        elif isinstance(node, ast.ImportFrom):
            assert not node.level, f"{path}: a relative import; hybridlb imports by absolute names"
            base = node.module or ""
            if not base.startswith("hybridlb"):
                continue
            for alias in node.names:  # `from hybridlb.engine import kv_cache` imports a module
                submodule = f"{base}.{alias.name}"
                found.add(submodule if _module_path(submodule) else base)
    return found


def _module_path(module: str) -> Path | None:
    relative = Path(*module.split(".")[1:])
    for candidate in (ROOT / relative.with_suffix(".py"), ROOT / relative / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _graph() -> dict[str, set[str]]:
    graph = {}
    for path in sorted(ROOT.rglob("*.py")):
        relative = path.relative_to(ROOT.parent).with_suffix("")
        name = ".".join(relative.parts).removesuffix(".__init__")
        if name == "hybridlb.__main__":
            continue
        graph[name] = {m for m in _imports(path) if m != name}
    return graph


def test_imports_only_run_down_the_layers():
    wrong = []
    for module, imported in _graph().items():
        part = _part(module)
        if module == "hybridlb":  # the package's front door: `from hybridlb import LLM` (loaded when asked for)
            allowed = BASE | {"llm"}
        elif part in BASE:
            allowed = BASE
        else:
            allowed = BASE | ALLOWED[part] | {part}
        wrong += [f"{module} imports {target}" for target in imported if _part(target) not in allowed]
    assert not wrong, "\n".join(wrong)


def test_no_module_imports_itself_in_a_circle():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            if state.get(target) == 1:
                circles.append(" -> ".join([*path[path.index(target):], target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, "\n".join(circles)


def test_only_the_vllm_backend_imports_vllm():
    """vLLM's internals are touched in one place, which tests/vllm/test_contract.py pins."""
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if "vllm_backend" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            found += [f"{path.relative_to(ROOT.parent)} imports {name}" for name in names
                      if name == "vllm" or name.startswith("vllm.")]
    assert not found, "\n".join(found)
