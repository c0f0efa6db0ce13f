"""planner/'s import graph, read from the source: no circle between modules, imports between stages that
point one way, and no module named after a public name.

Why it exists: planner/ is being split into one package per stage of the pipeline (issue 36,
docs/layout.md), and a layout stays one only while a test says so. The test parses the source with ast and
imports nothing, so it sees every import wherever it stands (NOTE [every import counts]).

NOTE [every import counts]: an import inside a function or under `if TYPE_CHECKING:` does not run when its
module loads, so Python tolerates a circle held apart that way. A reader does not: neither module can be
read, or type-checked, without the other. planner/'s circle through `Plan` was of that kind, so a test
counting only the imports that run at load time would have passed it.

`TOLERATED_CYCLES` is a ratchet while the layout changes: a circle listed there passes, a new one fails,
and so does a listed one that has gone, so the list can only shrink.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parent.parent
PACKAGE = "planner"

STAGES: dict[str, int] = {
    # the contract: plain data, errors, their JSON form, the checks of posted graphs; the example models
    "ir": 0,
    "errors": 0,
    "serialize": 0,
    "validate": 0,
    "zoo": 0,
    "simulation": 1,  # the torch-free models of a step and of CUDA's caching allocator
    "capture": 2,  # model -> fx graph
    "profiler": 3,  # fx graph -> ActivationGraph
    "solvers": 4,  # ActivationGraph -> Schedule, without torch
    "rewrite": 5,  # Schedule -> checkpointed module
    "report": 6,  # a solved plan explained: text, pictures, code, hand checkpoints
    "planning": 7,  # the pipeline put together: Plan, plan_graph and the frontier, profile and Profile
    "compiled": 8,  # compile=True: the step torch.compile runs, planned inside inductor
    "one_call": 9,  # optimize, pareto, measure
    "pipelining": 9,  # optimize_pipeline: a plan per pipeline stage
    "sizing": 10,  # capacity: the size search, its table, rescaled graphs, fitting and weighing
    "client": 11,  # the entry points
    "cli": 11,
    "demo": 11,
    "__init__": 11,
    "testing": 12,
}
"""The stage of each package or top-level module of planner/ (docs/layout.md): a module may import its own
stage and earlier ones, never a later one. The ranks are those of issue 36's table; every module of
planner/ is in one (`test_every_module_of_planner_has_a_stage`)."""

TOLERATED_CYCLES: list[set[str]] = []
"""Circles not broken yet, as sets of module names without the `planner.` prefix. The last one went through
`Plan` (plan, report, export, plots, profiling, graph_api) until the report took a `SolvedPlan`
(solvers/solved_plan.py) and `Plan.profile` a `ProfiledStep`."""


def module_name(path: Path, root: Path) -> str:
    """planner/solvers/dp.py -> planner.solvers.dp, planner/solvers/__init__.py -> planner.solvers."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path, package: str) -> dict[str, Path]:
    return {module_name(path, root): path for path in sorted((root / package).rglob("*.py"))}


def known_module(name: str, known: dict[str, Path]) -> str | None:
    """The module of ours that `name` (a module, or a name defined in one) refers to, if any."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        if ".".join(parts[:end]) in known:
            return ".".join(parts[:end])
    return None


def absolute_base(node: ast.ImportFrom, package: str) -> str:
    """The module a `from ... import` statement imports from, with a relative one made absolute."""
    if not node.level:
        return node.module or ""
    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
    return ".".join(anchor + ([node.module] if node.module else []))


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every module of ours that module `name` imports, wherever the import stands (NOTE [every import
    counts]). `from planner.report import naming` counts as an import of planner.report.naming, and `from
    planner.planning.plan import Plan` as one of planner.planning.plan (not of the packages above it,
    whose `__init__` also runs)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {known_module(alias.name, known) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = absolute_base(node, package)
            found |= {known_module(f"{base}.{alias.name}", known) for alias in node.names}
    return {module for module in found if module is not None and module != name}


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    known = modules(root, package)
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        on_stack.add(module)

    for root in sorted(edges):
        if root in index:
            continue
        visit(root)
        work = [(root, iter(sorted(edges[root])))]
        while work:
            module, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    visit(target)
                    work.append((target, iter(sorted(edges.get(target, ())))))
                elif target in on_stack:
                    low[module] = min(low[module], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[module])
            if low[module] == index[module]:
                component = {stack.pop()}
                while module not in component:
                    component.add(stack.pop())
                on_stack -= component
                if len(component) > 1:
                    found.append(component)
    return found


def short(name: str) -> str:
    return name.removeprefix(PACKAGE + ".")


def stage_of(name: str) -> str:
    """planner.solvers.dp -> solvers; the package itself -> __init__."""
    return name.split(".")[1] if "." in name else "__init__"


def public_names() -> list[str]:
    """planner.__all__, read from planner/__init__.py without importing it."""
    tree = ast.parse((REPOSITORY / PACKAGE / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(target, ast.Name) and target.id == "__all__" for target in node.targets
        ):
            names: list[str] = ast.literal_eval(node.value)
            return names
    raise AssertionError("planner/__init__.py has no __all__")


def test_no_import_cycles_but_the_tolerated() -> None:
    found = [{short(name) for name in component} for component in cycles(import_graph(REPOSITORY, PACKAGE))]
    new = [component for component in found if component not in TOLERATED_CYCLES]
    gone = [component for component in TOLERATED_CYCLES if component not in found]
    assert not new, f"import cycles (function-level and TYPE_CHECKING imports counted): {new}"
    assert not gone, f"these cycles are gone; take them off TOLERATED_CYCLES: {gone}"


def test_imports_point_to_earlier_stages() -> None:
    upward = []
    for name, targets in import_graph(REPOSITORY, PACKAGE).items():
        for target in targets:
            source, destination = stage_of(name), stage_of(target)
            if source in STAGES and destination in STAGES and STAGES[source] < STAGES[destination]:
                upward.append(f"{short(name)} ({source}) imports {short(target)} ({destination})")
    assert not upward, "imports from an earlier stage to a later one:\n" + "\n".join(sorted(upward))


def test_every_stage_names_a_module_of_planner() -> None:
    """A stage listed for a module that is not there checks nothing; a misspelt one would pass silently."""
    entries = (REPOSITORY / PACKAGE).iterdir()
    present = {entry.stem for entry in entries if entry.is_dir() or entry.suffix == ".py"}
    missing = sorted(set(STAGES) - present)
    assert not missing, f"STAGES lists what planner/ does not have: {missing}"


def test_every_module_of_planner_has_a_stage() -> None:
    """A module outside STAGES is checked by no rule of direction: a new one says where it stands."""
    unstaged = sorted({stage_of(name) for name in modules(REPOSITORY, PACKAGE)} - set(STAGES))
    assert not unstaged, f"planner/ has modules or packages STAGES does not list: {unstaged}"


@pytest.mark.parametrize("public", public_names())
def test_no_module_shadows_a_public_name(public: str) -> None:
    """`planner.profile`, `planner.capacity` and the other functions load through `planner.__getattr__`.
    Importing a module or package `planner/profile` binds it as the attribute `planner.profile`, and from
    then on `planner.profile(model, ...)` raises "module is not callable"."""
    shadows = [PACKAGE + "/" + public, f"{PACKAGE}/{public}.py"]
    assert not any((REPOSITORY / path).exists() for path in shadows), f"{shadows} would hide planner.{public}"


def test_every_kind_of_import_makes_an_edge(tmp_path: Path) -> None:
    """The walk itself, on a package made for it: an import at the top, in a function, under
    TYPE_CHECKING, relative, and of a module by `from package import module` all count."""
    files = {
        "pkg/__init__.py": "",
        "pkg/top.py": "import pkg.inner\n",
        "pkg/inner.py": "def f():\n    from pkg import late\n",
        "pkg/late.py": "import typing\nif typing.TYPE_CHECKING:\n    from .sub.deep import Thing\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/deep.py": "from ..top import something\nfrom os import path\n",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    edges = import_graph(tmp_path, "pkg")
    assert edges == {
        "pkg": set(),
        "pkg.top": {"pkg.inner"},
        "pkg.inner": {"pkg.late"},
        "pkg.late": {"pkg.sub.deep"},
        "pkg.sub": set(),
        "pkg.sub.deep": {"pkg.top"},
    }
    assert cycles(edges) == [{"pkg.top", "pkg.inner", "pkg.late", "pkg.sub.deep"}]
