"""The package's architecture, frozen: grpoflow's modules import one another without cycles, each
layer imports only the layers below it, every flat option key has exactly one owner, and no module,
function or part of the package outgrows the sizes that keep it readable.

The import graph is read from the source with `ast`, without importing it. Every import of a
grpoflow module counts wherever it is written: at module level, inside a function, or under
`if TYPE_CHECKING`. `from grpoflow.x import y` is an import of the module `grpoflow.x.y` when `y` is
a submodule, else of `grpoflow.x` (its `__init__.py`, a node of its own).
"""

from __future__ import annotations

import ast
import importlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import pytest

PACKAGE = "grpoflow"
PACKAGE_DIR = Path(__file__).resolve().parents[1] / PACKAGE

LAYERS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    (
        "foundations",
        ("algo", "options", "hub", "imports", "threads", "phases", "distributed"),
        "pure tensor maths; config loading that knows no particular config; the model hub; user code by import path and in daemon threads; seconds per phase of a step; the processes of a run and their collectives",
    ),
    ("kernels", ("kernels",), "the decoder layer's operations: torch reference ops and their Triton kernels"),
    (
        "models",
        ("models",),
        "the decoder families the native engine runs: their forwards over a paged cache, on the kernels' operations",
    ),
    ("transport", ("transport",), "moving weights to rollout engines, sender and receiver sides"),
    ("engines", ("engines",), "rollout engines, their interface and the one definition of sampling settings"),
    (
        "remote",
        ("remote",),
        "the client of rollout servers: the engine over HTTP, what each server offers, the weight transfer chosen from it",
    ),
    ("rewards", ("rewards",), "scoring completions (they read the sampling budget: max_completion_length)"),
    ("tasks", ("tasks",), "packaged tasks: their rows and the rewards they register"),
    ("components", ("data", "policy"), "prompts of named tasks; the policy being trained"),
    (
        "chat",
        ("chat",),
        "what agents and the server share: tool calls read from a turn, an agent program's recorded turns",
    ),
    (
        "multi-turn",
        ("agents", "server"),
        "episodes of several turns (tools, environments, their token ids); `grpoflow serve`, the policy over vLLM's HTTP protocol",
    ),
    (
        "rollout",
        ("rollout",),
        "sources of scored groups (which may host the serve app for agent programs), and groups to training tensors",
    ),
    (
        "learn",
        ("learn",),
        "the learner: the objective's options, advantages, log-probs, micro-batched updates",
    ),
    ("report", ("report",), "the run report: a run's output directory read back and drawn as one HTML page"),
    (
        "assemblies",
        ("run",),
        "one training run: the loop and its services (checkpoints, health, evaluation, logs)",
    ),
    ("api", ("api",), "the Python API in TRL's shape (GRPOConfig, GRPOTrainer), over the run's assembly"),
    ("cli", ("cli",), "the command line, over every assembly"),
    ("entry", ("__main__",), "`python -m grpoflow`: the command line"),
    (
        "root",
        (PACKAGE,),
        "the package's own __init__, run before any of its modules: imports none of them when it runs; "
        "its module `__getattr__` hands out the API on first use",
    ),
)
"""Layers from the bottom up (name, parts, reason): each part of the package (its first name under
grpoflow, or the package itself) imports only itself and parts of lower layers, never another part
of its own layer. So no engine, reward, transport or other component reads the run's config
(`grpoflow.run`), the server or the command line."""

OPTION_ROOTS = ("grpoflow.run.config:GRPOConfig", "grpoflow.server.settings:ServeConfig")
"""The configs read from flat option keys (`--key value`, YAML keys)."""


@dataclass(frozen=True, slots=True)
class Import:
    """One import statement's edge from module `source` to module `target`."""

    source: str
    target: str
    path: Path
    line: int

    @property
    def where(self) -> str:
        """file:line of the statement, relative to the repository."""
        return f"{self.path.relative_to(PACKAGE_DIR.parent)}:{self.line}"


def module_files() -> dict[str, Path]:
    """Every module of the package by dotted name; a package is named by its `__init__.py`."""
    modules = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _existing(name: str, modules: dict[str, Path]) -> str:
    """`name`, or the longest prefix of it that is a module (`grpoflow.x.attr` -> `grpoflow.x`)."""
    while name not in modules and "." in name:
        name = name.rpartition(".")[0]
    return name


def _from_base(node: ast.ImportFrom, source: str, path: Path) -> str:
    """The absolute module a `from ... import` statement reads from."""
    if not node.level:
        return node.module or ""
    package = source if path.name == "__init__.py" else source.rpartition(".")[0]
    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
    return f"{anchor}.{node.module}" if node.module else anchor


def _targets(node: ast.AST, source: str, path: Path, modules: dict[str, Path]) -> Iterator[str]:
    """The grpoflow modules one import statement imports."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            if alias.name == PACKAGE or alias.name.startswith(f"{PACKAGE}."):
                yield _existing(alias.name, modules)
    elif isinstance(node, ast.ImportFrom):
        base = _from_base(node, source, path)
        if base != PACKAGE and not base.startswith(f"{PACKAGE}."):
            return
        for alias in node.names:
            submodule = f"{base}.{alias.name}"
            yield submodule if submodule in modules else _existing(base, modules)


def package_imports() -> list[Import]:
    """Every import of a grpoflow module written in the package, in file and line order."""
    modules = module_files()
    imports = []
    for source, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            for target in _targets(node, source, path, modules):
                if target != source:
                    imports.append(Import(source, target, path, node.lineno))
    return sorted(set(imports), key=lambda edge: (str(edge.path), edge.line, edge.target))


def import_time_graph(imports: list[Import]) -> dict[str, dict[str, str]]:
    """source -> target -> why, for the modules each module runs when imported.

    Importing `grpoflow.x.y` from outside the package `grpoflow.x` first runs `grpoflow/x/__init__.py`,
    so that is an edge too. From inside `grpoflow.x` it is not: that `__init__` already started.
    """
    graph: dict[str, dict[str, str]] = {}
    for edge in imports:
        graph.setdefault(edge.source, {}).setdefault(edge.target, f"{edge.where} imports {edge.target}")
        parts = edge.target.split(".")
        for depth in range(2, len(parts)):
            parent = ".".join(parts[:depth])
            if edge.source != parent and not edge.source.startswith(f"{parent}."):
                why = f"{edge.where} imports {edge.target}, which first runs {parent}"
                graph[edge.source].setdefault(parent, why)
    return graph


def strongly_connected(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """The strongly connected components of `graph` (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, {}))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    components.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, {})))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return components


def shortest_cycle(graph: dict[str, dict[str, str]], start: str, within: set[str]) -> list[str]:
    """The shortest path start -> ... -> start inside `within`, as its list of nodes."""
    previous: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for child in sorted(graph.get(node, {})):
            if child not in within:
                continue
            if child == start:
                path = [node]
                while path[-1] != start:
                    path.append(previous[path[-1]])
                return [*reversed(path), start]
            if child not in previous:
                previous[child] = node
                queue.append(child)
    raise AssertionError(f"{start} is on no cycle inside {sorted(within)}")


def import_cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """The shortest cycle through each module that is on one, each cycle once, from its least node."""
    cycles = []
    for component in strongly_connected(graph):
        if len(component) < 2:
            continue
        for node in component:
            cycle = shortest_cycle(graph, node, set(component))
            first = cycle.index(min(cycle[:-1]))
            rotated = [*cycle[first:-1], *cycle[:first], cycle[first]]
            if rotated not in cycles:
                cycles.append(rotated)
    return cycles


def part_of(module: str) -> str:
    """The part of the package `module` belongs to: its first name under grpoflow."""
    return module.split(".")[1] if "." in module else module


def layer_of(part: str) -> int | None:
    """The index in LAYERS of the layer holding `part`; None for a part in no layer."""
    return next((level for level, (_, parts, _) in enumerate(LAYERS) if part in parts), None)


def test_modules_import_no_cycle():
    graph = import_time_graph(package_imports())
    reports = []
    for cycle in import_cycles(graph):
        steps = [f"    {graph[a][b]}" for a, b in pairwise(cycle)]
        reports.append("\n".join([" -> ".join(cycle), *steps]))
    assert not reports, f"{len(reports)} import cycle(s):\n" + "\n".join(reports)


def test_every_part_of_the_package_has_a_layer():
    unplaced = sorted(
        {part_of(name) for name in module_files()} - {p for _, parts, _ in LAYERS for p in parts}
    )
    assert not unplaced, f"parts of grpoflow in no layer of LAYERS: {unplaced}"


def test_layers_import_only_downwards():
    violations = []
    for edge in package_imports():
        source, target = layer_of(part_of(edge.source)), layer_of(part_of(edge.target))
        if part_of(edge.source) == part_of(edge.target) or source is None or target is None:
            continue
        if target >= source:
            violations.append(
                f"{edge.where}: {edge.source} ({LAYERS[source][0]}) imports {edge.target} ({LAYERS[target][0]})"
            )
    assert not violations, f"{len(violations)} import(s) against the layers:\n" + "\n".join(violations)


@pytest.mark.parametrize("root", OPTION_ROOTS)
def test_every_flat_option_key_has_one_owner(root: str):
    options = importlib.import_module("grpoflow.options")
    if not hasattr(options, "flat_fields"):
        pytest.skip("grpoflow.options.flat_fields(root_cls) (flat key -> field path) does not exist yet")
    module_name, _, class_name = root.partition(":")
    root_cls = getattr(importlib.import_module(module_name), class_name)
    try:
        fields = options.flat_fields(root_cls)
    except ValueError as error:
        pytest.fail(f"{root}: a flat option key has more than one owner: {error}")
    assert fields, f"{root} has no flat option keys"


MAX_FILE_LINES = 500
"""Lines a module of the package may hold."""
MAX_FUNCTION_LINES = 80
"""Lines a function may span, GPU kernels (`@triton.jit`) aside: a kernel is one launch."""
MAX_PACKAGE_LINES = 5_000
"""Lines a part of the package (a first-level folder) may hold in all."""


def _is_gpu_kernel(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return any("jit" in ast.unparse(decorator) for decorator in node.decorator_list)


def test_no_file_is_over_the_limit():
    lengths = {name: len(path.read_text().splitlines()) for name, path in module_files().items()}
    long = sorted(f"{name}: {lines}" for name, lines in lengths.items() if lines > MAX_FILE_LINES)
    assert not long, f"modules over {MAX_FILE_LINES} lines (split them by job): {long}"


def test_no_function_is_over_the_limit():
    long = []
    for name, path in module_files().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not _is_gpu_kernel(node):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{name}.{node.name}: {lines}")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (cut them into named steps): {long}"


def test_no_part_of_the_package_is_over_the_limit():
    totals: dict[str, int] = {}
    for name, path in module_files().items():
        totals[part_of(name)] = totals.get(part_of(name), 0) + len(path.read_text().splitlines())
    large = sorted(f"{part}: {lines}" for part, lines in totals.items() if lines > MAX_PACKAGE_LINES)
    assert not large, (
        f"parts of grpoflow over {MAX_PACKAGE_LINES} lines (split them by what they do): {large}"
    )
