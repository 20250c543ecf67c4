"""The layering rules of ARCHITECTURE.md, checked by scanning every module's imports.

Stated exactly, never widened to fit the code:
- the shared parts of syncer (`syncer.wire`: protocol, codec, fragments; `syncer.common`:
  settings, the resolved configuration, keys, JSON lines, fault points, atomic writes, strict JSON,
  small math) are leaves: they import nothing of the project outside these shared parts;
- learner imports of syncer only those shared parts (never the server, the core or the merge),
  and never dldctl;
- workload (the model/data seam shared by learners, the syncer's evaluator and the benchmarks)
  imports of the project only syncer.common (its atomic writes);
- syncer never imports learner or dldctl, and only its evaluator shell imports workload;
- dldctl imports of syncer only the shared parts (it talks to a running syncer through the wire
  protocol), never learner, and of workload only the torch-free preset table, so validating an
  inventory needs no torch;
- learner, syncer and workload never import the operator-only packages typer, rich, paramiko,
  matplotlib;
- the harness that tests and benchmarks drive dldctl with (`dldctl.testing`) is dldctl and keeps
  its rules; it imports neither torch nor the code built on it (tests, bench);
- dldctl's folders are floors (FLOORS, docs/architecture.md): a module imports only from its own
  floor and the floors below it, at file level, inside functions and under TYPE_CHECKING alike.

Probes that show a check failing are written under pytest's tmp_path, never into the source tree.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROJECT = ("dldctl", "learner", "syncer", "workload")
SHARED = ("syncer.wire", "syncer.common")  # the only parts of syncer other packages may import
SYNCER_MAY_BUILD_MODELS = ("syncer/evaluator.py",)  # the shell that evaluates the global model
DLDCTL_MAY_USE_OF_WORKLOAD = {"workload.presets"}  # stdlib only: no torch on the operator's path
OPERATOR_ONLY = ("typer", "rich", "paramiko", "matplotlib")
HARNESS = "dldctl/testing"  # tests/ and bench/ build on it, never the other way round
NOT_IN_THE_HARNESS = ("torch", "tests", "bench")


def shared(module: str) -> bool:
    """Whether a module name is one of syncer's shared parts (or the shared package itself)."""
    return any(module == pkg or module.startswith(pkg + ".") for pkg in SHARED)


def _dotted(path: Path) -> list[str]:
    """A file's module path as parts: relative to the checkout, or, for a probe outside it, from
    the first project package on its path (tmp/dldctl/hosts/p.py: dldctl, hosts, p)."""
    try:
        return list(path.relative_to(ROOT).with_suffix("").parts)
    except ValueError:
        parts = path.with_suffix("").parts
        first = min(i for i, part in enumerate(parts[:-1]) if part in PROJECT)  # a file may be learner.py
        return list(parts[first:])


def imports(path: Path) -> set[str]:
    """Absolute module names imported by a file (relative imports resolved to the package)."""
    tree = ast.parse(path.read_text(), str(path))
    package = ".".join(_dotted(path)[:-1])
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names if _is_module(f"{base}.{alias.name}"))
    return out


def _is_module(name: str, root: Path = ROOT) -> bool:
    """Whether a dotted name is a project module (not a class or function inside one)."""
    rel = Path(*name.split("."))
    return (root / rel.with_suffix(".py")).exists() or (root / rel / "__init__.py").exists()


def files(package: str, root: Path = ROOT) -> list[Path]:
    return sorted((root / package).rglob("*.py"))


def project_imports(path: Path) -> set[str]:
    found = {m for m in imports(path) if m.split(".")[0] in PROJECT}
    # `from syncer import codec` yields both "syncer" and "syncer.wire.codec": keep the precise one
    return {m for m in found if not any(other.startswith(m + ".") for other in found)}


def test_there_is_something_to_scan() -> None:
    assert len(files("syncer")) > 5 and len(files("learner")) > 5 and len(files("dldctl")) > 5


def shared_files() -> list[Path]:
    return [p for pkg in SHARED for p in files(pkg.replace(".", "/"))]


@pytest.mark.parametrize("path", shared_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_the_shared_parts_are_leaves(path: Path) -> None:
    assert {m for m in project_imports(path) if not shared(m)} == set()
    assert not {m for m in imports(path) if m.split(".")[0] in OPERATOR_ONLY}


@pytest.mark.parametrize("path", files("syncer"), ids=lambda p: p.name)
def test_syncer_never_imports_learner_or_dldctl_or_operator_packages(path: Path) -> None:
    mods = imports(path)
    assert not {m for m in mods if m.split(".")[0] in ("learner", "dldctl")}
    assert not {m for m in mods if m.split(".")[0] in OPERATOR_ONLY}
    if str(path.relative_to(ROOT)) not in SYNCER_MAY_BUILD_MODELS:
        assert not {m for m in mods if m.split(".")[0] == "workload"}


@pytest.mark.parametrize("path", files("workload"), ids=lambda p: p.name)
def test_workload_imports_only_the_common_leaves(path: Path) -> None:
    mods = project_imports(path)
    assert {m for m in mods if not m.startswith("workload") and not m.startswith("syncer.common")} == set()
    assert not {m for m in imports(path) if m.split(".")[0] in OPERATOR_ONLY}


def learner_violations(path: Path) -> set[str]:
    """What a learner module imports that it may not: dldctl, any unshared part of syncer, operator packages."""
    mods = project_imports(path)
    bad = {m for m in mods if m.startswith("dldctl") or (m.split(".")[0] == "syncer" and not shared(m))}
    return bad | {m for m in imports(path) if m.split(".")[0] in OPERATOR_ONLY}


def dldctl_violations(path: Path) -> set[str]:
    """What a dldctl module imports that it may not: learner, unshared syncer, torch-needing workload."""
    mods = project_imports(path)
    bad = {m for m in mods if m.split(".")[0] == "learner" or (m.split(".")[0] == "syncer" and not shared(m))}
    return bad | {m for m in mods if m.split(".")[0] == "workload" and m not in DLDCTL_MAY_USE_OF_WORKLOAD}


@pytest.mark.parametrize("path", files("learner"), ids=lambda p: p.name)
def test_learner_uses_only_the_shared_parts_of_syncer(path: Path) -> None:
    assert learner_violations(path) == set()


@pytest.mark.parametrize("path", files("dldctl"), ids=lambda p: str(p.relative_to(ROOT)))
def test_dldctl_uses_only_the_shared_parts_and_never_the_learner(path: Path) -> None:
    assert dldctl_violations(path) == set()


def harness_violations(path: Path) -> set[str]:
    """What the harness imports that it may not: dldctl's forbidden imports, torch, tests, bench."""
    return dldctl_violations(path) | {m for m in imports(path) if m.split(".")[0] in NOT_IN_THE_HARNESS}


def test_the_harness_needs_no_torch_and_no_test_code() -> None:
    parts = sorted((ROOT / HARNESS).glob("*.py"))
    assert len(parts) > 1 and {p.name: harness_violations(p) for p in parts} == {p.name: set() for p in parts}


@pytest.mark.parametrize(
    "package, source, rule",
    [
        ("dldctl", "from learner import trainer\n", dldctl_violations),
        ("dldctl", "from workload import gpt\n", dldctl_violations),
        ("dldctl", "import syncer.server\n", dldctl_violations),
        ("dldctl", "import torch\n", harness_violations),
        ("dldctl", "from tests.localrun import LocalRun\n", harness_violations),
        ("learner", "from syncer import server\n", learner_violations),
        ("learner", "from syncer.merge import merge\n", learner_violations),
        ("learner", "import dldctl.lifecycle.up\n", learner_violations),
    ],
)
def test_a_reintroduced_forbidden_import_fails(tmp_path: Path, package: str, source: str, rule: object) -> None:
    probe = tmp_path / package / "_layering_probe.py"
    probe.parent.mkdir()
    probe.write_text(source)
    assert callable(rule) and rule(probe), source


# dldctl's floors, top to bottom (docs/architecture.md). A module imports only from its own floor
# and the floors below: its floor is its longest listed prefix, and every top-level module of dldctl
# not listed is the run model. The base, the package itself included, anyone may import.
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("face", ("dldctl.cli", "dldctl.__main__", "dldctl.commands", "dldctl.testing")),
    ("chaos", ("dldctl.chaos",)),  # fault experiments: plans, runner, verdicts, records, inject
    ("lifecycle", ("dldctl.lifecycle",)),  # up, down, check, converge, resume, provision, export
    ("observe", ("dldctl.observe",)),  # the read side: snapshot, view, report, runs, logs
    ("supervise", ("dldctl.supervise",)),  # the supervisor and what only it runs: launch, sinks, alerts
    ("faults", ("dldctl.faults",)),  # fault mechanics: process faults, link faults
    ("run model", ()),  # inventory, rundir, runstate, hostruntime, syncerctl, eventlog, ...
    ("hosts", ("dldctl.hosts",)),  # transports: local, ssh, slurm
    ("base", ("dldctl.errors", "dldctl.units", "dldctl.interrupts", "dldctl.docpath", "dldctl.sim")),
)
RUN_MODEL = [name for name, _ in FLOORS].index("run model")
BASE = len(FLOORS) - 1


def floor_of(module: str) -> int:
    """The floor (0 = the top) of a dldctl module."""
    if module == "dldctl":
        return BASE
    hits = [
        (len(prefix), index)
        for index, (_, prefixes) in enumerate(FLOORS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    return max(hits)[1] if hits else RUN_MODEL


def floor_violations(path: Path) -> set[str]:
    """The dldctl modules a dldctl file imports from a floor above its own (any import: file level,
    in a function, under TYPE_CHECKING)."""
    here = floor_of(_module_name(path))
    return {m for m in imports(path) if m.split(".")[0] == "dldctl" and floor_of(m) < here}


@pytest.mark.parametrize("path", files("dldctl"), ids=lambda p: str(p.relative_to(ROOT)))
def test_dldctl_imports_only_its_own_floor_and_below(path: Path) -> None:
    assert floor_violations(path) == set(), FLOORS[floor_of(_module_name(path))][0]


def test_every_floor_is_where_the_tree_has_it() -> None:
    names = {_module_name(p) for p in files("dldctl")}
    for _, prefixes in FLOORS:
        for prefix in prefixes:
            assert prefix in names, prefix
    assert [FLOORS[floor_of(m)][0] for m in ("dldctl.inventory", "dldctl.hosts.ssh", "dldctl", "dldctl.sim.paper")] == [
        "run model",
        "hosts",
        "base",
        "base",
    ]


@pytest.mark.parametrize(
    "where, source",
    [
        ("hosts/_probe.py", "from dldctl.runstate import RunState\n"),  # hosts under the run model
        ("_probe.py", "from dldctl.observe import snapshot\n"),  # the run model reading up
        ("supervise/_probe.py", "def f() -> None:\n    from dldctl.lifecycle import up\n"),  # in a function
        ("faults/_probe.py", "from dldctl.supervise import launch\n"),
        ("observe/_probe.py", "from . import runs\nfrom ..chaos import plan\n"),  # relative, one level up
        ("sim/_probe.py", "from dldctl import runstate\n"),  # the pure simulator reads only the base
    ],
)
def test_an_import_against_the_floors_fails(tmp_path: Path, where: str, source: str) -> None:
    probe = tmp_path / "dldctl" / where
    probe.parent.mkdir(parents=True, exist_ok=True)
    probe.write_text(source)
    assert floor_violations(probe), (where, source)
    probe.write_text("from dldctl.errors import RunError\n")  # the base: allowed everywhere
    assert floor_violations(probe) == set(), where


def test_a_probe_named_like_a_package_is_placed_by_its_folder(tmp_path: Path) -> None:
    probe = tmp_path / "dldctl" / "commands" / "learner.py"  # the face's learner.py, not the learner package
    probe.parent.mkdir(parents=True)
    probe.write_text("from dldctl.commands import options\nfrom dldctl.chaos import plan\n")
    assert _module_name(probe) == "dldctl.commands.learner" and floor_violations(probe) == set()


# The pure core of ARCHITECTURE.md: no I/O (files, sockets, processes, clocks, sleeps); clocks and
# RNGs come in as arguments. (`time` may be imported for a default clock argument, never called bare.)
PURE_CORE = (
    "syncer/wire/protocol.py",
    "syncer/wire/codec.py",
    "syncer/wire/quant.py",
    "syncer/wire/fragments.py",
    "syncer/wire/shards.py",
    "syncer/merge.py",
    "syncer/fused.py",
    "syncer/rounds.py",
    "syncer/core.py",
    "syncer/admission.py",
    "syncer/pushcheck.py",
    "syncer/roundbook.py",
    "syncer/outerstep.py",
    "syncer/accounting.py",
    "syncer/status.py",
    "learner/outer.py",
    "learner/schedule.py",
    "learner/link.py",
    "learner/pushqueue.py",
    "learner/replica.py",
    "workload/gpt.py",
    "dldctl/supervise/reconcile.py",
    "dldctl/runstate.py",
    "dldctl/hostruntime.py",
    "dldctl/supervise/alerts.py",
    "dldctl/hosts/slurmjobs.py",
    "dldctl/faults/linkcap.py",
    "dldctl/units.py",
    "dldctl/chaos/plan.py",
    "dldctl/chaos/verdict.py",
    "dldctl/chaos/records.py",
    "dldctl/observe/view_keys.py",
    "dldctl/observe/view_frame.py",
    "dldctl/observe/view_overlay.py",
    "dldctl/observe/snapshot_model.py",
    "dldctl/observe/snapshot_parts.py",
    "dldctl/observe/snapshot_fields.py",
    *(f"dldctl/sim/{p.name}" for p in sorted((ROOT / "dldctl" / "sim").glob("*.py"))),
)
IO_MODULES = {
    "socket",
    "subprocess",
    "zmq",
    "paramiko",
    "shutil",
    "tempfile",
    "pathlib",
    "requests",
    "urllib",
    "http",
    "multiprocessing",
    "asyncio",
    "signal",
    "fcntl",
}
IO_CALLS = {
    "open",
    "print",
    "input",
    "sleep",
    "time",
    "monotonic",
    "perf_counter",
    "system",
    "popen",
    "remove",
    "unlink",
    "mkdir",
    "makedirs",
    "replace",
    "rename",
}


def io_calls(path: Path) -> set[str]:
    """Names of I/O-looking calls in a file: open(), time.sleep(), os.remove(), ... (any receiver)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call):
            fn = node.func
            name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
            receiver = fn.value.id if isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) else ""
            bare = receiver == "" and name in ("open", "print", "input")  # `replace` is dataclasses'
            if bare or (name in IO_CALLS and receiver in ("os", "time", "sys", "builtins")):
                found.add(f"{receiver + '.' if receiver else ''}{name}")
    return found


@pytest.mark.parametrize("rel", PURE_CORE)
def test_the_pure_core_does_no_io(rel: str) -> None:
    path = ROOT / rel
    assert not {m for m in imports(path) if m.split(".")[0] in IO_MODULES}, rel
    assert io_calls(path) == set(), rel


def test_model_imports_only_torch_and_errors_is_a_leaf() -> None:
    model = {m for m in imports(ROOT / "workload" / "gpt.py") if m.split(".")[0] not in ("torch", "__future__")}
    assert model <= {"math", "typing", "workload", "workload.presets"}, model
    presets = {m.split(".")[0] for m in imports(ROOT / "workload" / "presets.py")} - {"__future__"}
    assert presets <= {"dataclasses"}, presets  # stdlib only: the operator validates without torch
    assert project_imports(ROOT / "dldctl" / "errors.py") == set()


def test_the_io_scan_catches_a_violation(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("import time, os\nx = time.time()\nopen('f')\nos.unlink('g')\n")
    assert io_calls(probe) == {"time.time", "open", "os.unlink"}
    probe.write_text("from dataclasses import replace\ndef f(clock, x):\n    return clock(), replace(x)\n")
    assert io_calls(probe) == set()


def test_the_scanner_catches_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "syncer" / "_layering_probe.py"
    bad.parent.mkdir()
    bad.write_text("from learner import trainer\nimport rich\n")
    assert "learner.trainer" in project_imports(bad)
    assert "rich" in imports(bad)


def _module_name(path: Path) -> str:
    parts = _dotted(path)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(path: Path, root: Path = ROOT) -> set[str]:
    """Project modules imported when `path` is imported (module level, outside `if TYPE_CHECKING:`)."""
    out: set[str] = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            continue
        for sub in ast.walk(node):
            if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                break  # a lazy import inside a function runs later, not at import time
            if isinstance(sub, ast.Import):
                out.update(a.name for a in sub.names)
            elif isinstance(sub, ast.ImportFrom) and sub.module and not sub.level:
                out.add(sub.module)
                out.update(f"{sub.module}.{a.name}" for a in sub.names if _is_module(f"{sub.module}.{a.name}", root))
    return {m for m in out if m.split(".")[0] in PROJECT}


def import_cycles(package: str, root: Path = ROOT) -> list[list[str]]:
    """Every circle of module-level imports among a package's modules (depth-first search)."""
    graph = {_module_name(p): _top_level_imports(p, root) for p in files(package, root)}
    cycles: list[list[str]] = []
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted((graph.get(node, set()) & graph.keys()) - {node}):
            if state.get(nxt) == 1:
                cycles.append([*path[path.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for start in sorted(graph):
        if start not in state:
            visit(start, [start])
    return cycles


@pytest.mark.parametrize("package", PROJECT)
def test_no_import_circles(package: str) -> None:
    assert import_cycles(package) == []


def test_the_circle_scan_finds_a_circle(tmp_path: Path) -> None:
    (tmp_path / "dldctl").mkdir()
    a, b = tmp_path / "dldctl" / "_circle_a.py", tmp_path / "dldctl" / "_circle_b.py"
    a.write_text("from dldctl import _circle_b\n")
    b.write_text("import dldctl._circle_a\n")
    assert ["dldctl._circle_a", "dldctl._circle_b", "dldctl._circle_a"] in import_cycles("dldctl", tmp_path)


THIRD_PARTY = ("typer", "rich", "zmq", "torch", "paramiko", "zstandard", "numpy", "matplotlib", "click")


def private_imports(names: set[str]) -> list[str]:
    """Imports of a dependency's private module (`typer._click`): they break under an open range."""
    return sorted(
        name
        for name in names
        if name.split(".")[0] in THIRD_PARTY and any(part.startswith("_") for part in name.split(".")[1:])
    )


@pytest.mark.parametrize(
    "path", [p for pkg in ("dldctl", "learner", "syncer", "workload") for p in files(pkg)], ids=lambda p: str(p)
)
def test_no_private_imports_of_dependencies(path: Path) -> None:
    assert private_imports(imports(path)) == []


def test_the_private_import_scan_catches_one() -> None:
    found = {"typer._click.exceptions", "torch._dynamo", "torch.nn", "dldctl._private", "rich.console"}
    assert private_imports(found) == ["torch._dynamo", "typer._click.exceptions"]
