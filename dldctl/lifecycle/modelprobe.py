"""The run's model built on its hosts before anything starts: `python -m workload.probe` as a
process on each host that runs learners and on the syncer's (shard 0 scores the global model).

    targets_for_run    at `up`, after the hosts are set up: each host's own Python and import
                       path, exactly as its processes will have them (launch.py)
    targets_unstarted  at `check` and `up --dry-run`: this machine's Python; a remote host's
                       `python` with the code, dldctl's workload package and an `hf:` model's
                       files shipped into its code store (codeship.py: no run is created there)
    probe_all          run them in parallel; `judge` (pure) turns the answers into problems

A built-in preset on the built-in corpus (the default) is never probed: its manifest is known on
the operator (workload/presets.py) and the corpus is every Python's own. A preset whose `[run] data`
is on disk (or that names a `tokenizer`) is probed for its data: the files must load on every host
that reads them, each learner's and the syncer's (it scores on the held-out tail). A problem names
the host, the side (learner or syncer), what failed (for the data: the file) and the fix;
different manifests on two hosts (another transformers, another factory, data of another
vocabulary) are a problem too, as are more `fragments` than the model has tensors.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import shlex
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dldctl import modelspec, rundir
from dldctl.errors import DldError, OperationError
from dldctl.hostruntime import HostRuntime
from dldctl.hosts import Host, LocalHost
from dldctl.inventory import HostSpec, Inventory
from dldctl.lifecycle import codeship, modeldir
from dldctl.supervise import launch
from syncer.common.resolved import LearnerEntry, ResolvedConfig

Progress = Callable[[str, str], None]

FIX = {
    "import": "",  # the probe's own message says what to install or ship (workload._import)
    "build": "fix the factory (`dldctl logs` would show the same error from every learner)",
    "loss": "fix the model's loss (docs/custom-model.md)",
    "data": "every host that runs a learner, and the syncer's, reads [run] data (and tokenizer) at that path: "
    "put a good copy there (docs/data.md)",
    "host": "`dldctl check` tells more",
}


@dataclass(frozen=True)
class Target:
    """One probe: where, as which sides, with which Python and import path."""

    host: str  # an inventory host name, or "local" for a syncer on this machine
    roles: tuple[str, ...]  # "learner", "syncer"
    python: str
    pythonpath: str
    model_dir: str | None
    opener: Callable[[], Host] = field(compare=False)
    local: bool = False  # on this machine: one probe serves every local host with the same path

    @property
    def where(self) -> str:
        return f"host {self.host} ({' and '.join(self.roles)})"


@dataclass(frozen=True)
class Answer:
    """What the probe of one target said (`ok` false with `stage` and `error` when it failed)."""

    target: Target
    data: dict[str, Any]

    @property
    def ok(self) -> bool:
        return bool(self.data.get("ok"))

    @property
    def unprobed(self) -> bool:
        """The probe could not run yet (a dependency dldctl's set-up installs): not a model problem."""
        return self.data.get("stage") == "missing"

    def line(self) -> str:
        """One line for the operator: what was built, or why not."""
        if self.ok:
            return (
                f"{self.data['tensors']} tensors, {self.data['params']:,} parameters, manifest {self.data['manifest']}"
            )
        if self.unprobed:
            return f"not probed yet: {self.data.get('error')} (`up` installs it and probes again)"
        return str(self.data.get("error"))


def needed(inv: Inventory) -> bool:
    """Whether the run needs probing: a factory or an `hf:` model, or data on disk."""
    return modelspec.kind(inv.run.model) != "preset" or data_on_disk(inv)


def data_on_disk(inv: Inventory) -> bool:
    """Whether the run reads data files on its hosts: `[run] data` other than "builtin", or a
    `tokenizer` (the built-in corpus tokenized with it)."""
    return inv.run.data != "builtin" or bool(inv.run.tokenizer)


def refusal(problem: str) -> str:
    """What a problem of `judge` keeps from starting, for the first words of the error: the data
    (its fix names it) or the model."""
    return "the data does not load" if FIX["data"] in problem else "the model does not build"


def spec(inv: Inventory, roles: tuple[str, ...], model_dir: str | None) -> dict[str, Any]:
    """The probe's input (workload/probe.py): the learner side when the target runs learners."""
    return {
        "settings": inv.run.to_dict(),
        "model_args": dict(inv.model_args),
        "model_dir": model_dir,
        "shards": max(1, inv.total_learners),
        "role": "learner" if "learner" in roles else "syncer",
    }


def run_probe(target: Target, inv: Inventory, timeout: float = 600.0) -> Answer:
    """One probe on its host; a host that cannot run it at all is an answer too, never an exception."""
    payload = json.dumps(spec(inv, target.roles, target.model_dir)).encode()
    command = f"{shlex.quote(target.python)} -m workload.probe"
    host = target.opener()
    try:
        env = {"PYTHONPATH": target.pythonpath} if target.pythonpath else None
        result = host.run(command, input=payload, timeout=timeout, check=False, env=env)
        lines = result.stdout.strip().splitlines()
        if result.status != 0 or not lines:
            tail = " | ".join((result.stderr or result.stdout).strip().splitlines()[-2:])
            return Answer(target, {"ok": False, "stage": "build", "error": f"{target.python}: {tail or 'no answer'}"})
        return Answer(target, json.loads(lines[-1]))
    except (DldError, ValueError) as exc:
        return Answer(target, {"ok": False, "stage": "build", "error": str(exc)})
    finally:
        host.close()


def probe_all(targets: list[Target], inv: Inventory) -> list[Answer]:
    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(lambda t: run_probe(t, inv), targets))


def judge(answers: list[Answer], fragments: int) -> list[str]:
    """What keeps the run from starting, one line each (empty: the model builds alike everywhere). Pure."""
    problems = []
    for a in answers:
        if not a.ok and not a.unprobed:
            stage = str(a.data.get("stage", "build"))
            fix = FIX.get(stage, FIX["build"])
            if a.target.roles == ("syncer",):  # only the scorer fails: running unscored is the user's call
                fix = "; ".join(
                    filter(None, [fix, "or set [run] global_eval_every = 0 to run unscored (no quality guard)"])
                )
            problems.append(f"{a.target.where}: {a.data.get('error')}" + (f"; {fix}" if fix else ""))
    built = [a for a in answers if a.ok]
    digests = {str(a.data["manifest"]) for a in built}
    if len(digests) > 1:
        seen = ", ".join(f"{a.target.host}: {a.data['tensors']} tensors ({a.data['manifest']})" for a in built)
        problems.append(
            f"the model's parameters differ between hosts ({seen}); every learner and the syncer must build "
            "the same model: the same code (ship it with [run] workdir) and the same transformers version"
        )
    if built and fragments > int(built[0].data["tensors"]):
        tensors = built[0].data["tensors"]
        problems.append(f"[run] fragments = {fragments} but the model has only {tensors} parameter tensors")
    return problems


# -- the targets -------------------------------------------------------------------------------
def _merge(targets: list[Target]) -> list[Target]:
    """One probe per distinct (machine, Python, import path): the roles of equal ones joined."""
    out: dict[tuple[str, str, str, str | None], Target] = {}
    for t in targets:
        key = ("" if t.local else t.host, t.python, t.pythonpath, t.model_dir)
        old = out.get(key)
        roles = tuple(dict.fromkeys([*(old.roles if old else ()), *t.roles]))
        out[key] = replace(old or t, roles=roles)
    return list(out.values())


def targets_for_run(
    inv: Inventory,
    runtimes: dict[str, HostRuntime],
    learners: list[LearnerEntry],
    syncer_host: str,
    opener: Callable[[str], Host],
    model_dir: str | None,
) -> list[Target]:
    """After set-up: each host with learners as its first learner will start, and shard 0's host
    as the syncer will (`model_dir`: the run's copy, relative to a run directory)."""
    out: list[Target] = []
    for entry in learners:
        rt = runtimes.get(entry.host)
        if rt is not None and entry.host not in {t.host for t in out}:
            path = launch.learner_env(rt, entry, 0).get("PYTHONPATH", "")
            where = None if model_dir is None else f"{rt.run_dir}/{model_dir}"
            here = _is_local(inv, entry.host)
            out.append(
                Target(entry.host, ("learner",), rt.python, path, where, functools.partial(opener, entry.host), here)
            )
    rt = runtimes.get(syncer_host)
    if rt is not None and inv.run.global_eval_every > 0:
        path = launch.syncer_env(rt).get("PYTHONPATH", "")
        where = None if model_dir is None else f"{rt.run_dir}/{model_dir}"
        here = _is_local(inv, syncer_host)
        out.append(
            Target(syncer_host, ("syncer",), rt.python, path, where, functools.partial(opener, syncer_host), here)
        )
    return _merge(out)


def _is_local(inv: Inventory, name: str) -> bool:
    """Whether the host `name` is this machine ("local": a syncer here; a site's jobs run elsewhere)."""
    spec = next((h for h in inv.hosts if h.name == name), None)
    return spec is None or (spec.local and not spec.site)


def runtime_tree() -> codeship.Tree:
    """dldctl's own modules a probe needs on a host it has not set up: workload and syncer.common."""
    found = importlib.util.find_spec("workload")  # its files, read as data: dldctl does not import it
    assert found is not None and found.origin is not None, "dldctl's own workload package is not installed"
    root = Path(found.origin).resolve().parents[1]
    files = [*_under(root, "workload"), *_under(root, "syncer/common")]
    digest, size = codeship.file_hash(root / "syncer" / "__init__.py")
    files.append(codeship.Entry("syncer/__init__.py", digest, size, False))
    return codeship.Tree(root, tuple(sorted(files, key=lambda e: e.path)))


def _under(root: Path, rel: str) -> list[codeship.Entry]:
    return [codeship.Entry(f"{rel}/{e.path}", e.sha256, e.size, e.executable) for e in codeship.walk(root / rel)]


def targets_unstarted(inv: Inventory, tree: codeship.Tree | None) -> tuple[list[Target], list[Answer]]:
    """Before any run (`check`, `up --dry-run`): a target per host with learners and for the
    syncer's host; remote ones get the code shipped first. Hosts that cannot be probed yet
    (`setup = "venv"` before its environment exists, an unreachable host) come back as answers."""
    local_code = codeship.ship(LocalHost("local"), sys.executable, str(rundir.home()), tree).path if tree else ""
    hf_dir = modelspec.hf_path(inv.run.model) if modelspec.kind(inv.run.model) == "hf" else None
    wanted: list[tuple[HostSpec | None, tuple[str, ...]]] = [(h, ("learner",)) for h in inv.hosts if h.learners > 0]
    if inv.run.global_eval_every > 0:
        shard0 = inv.syncer.host
        wanted.append((None if shard0 == "local" else inv.host(shard0), ("syncer",)))
    local = [_local_target(h, roles, local_code, hf_dir) for h, roles in wanted if h is None or h.local]
    remote = [(h, roles) for h, roles in wanted if h is not None and not h.local]
    with ThreadPoolExecutor(max_workers=8) as pool:
        made = list(pool.map(lambda pair: _remote_target(inv, pair[0], pair[1], tree), remote))
    return _merge(local + [m for m in made if isinstance(m, Target)]), [m for m in made if isinstance(m, Answer)]


def _local_target(spec: HostSpec | None, roles: tuple[str, ...], code: str, hf_dir: str | None) -> Target:
    """This machine's Python, the code snapshot first and the host's own PYTHONPATH after it."""
    name = "local" if spec is None else spec.name
    path = ":".join(filter(None, [code, (spec.env.get("PYTHONPATH", "") if spec else "")]))
    return Target(name, roles, sys.executable, path, hf_dir, lambda: LocalHost(name), local=True)


def _remote_target(
    inv: Inventory, spec: HostSpec, roles: tuple[str, ...], tree: codeship.Tree | None
) -> Target | Answer:
    """Ship the code, dldctl's workload package and an `hf:` model's files into the host's code
    store; the target runs the host's `python` (its venv's, once `up` made it)."""
    from dldctl.hostopen import open_host
    from dldctl.lifecycle.provision import base_dir

    host = open_host(spec, inv.ssh)
    skipped = Target(spec.name, roles, spec.python, "", None, lambda: open_host(spec, inv.ssh))
    try:
        base = base_dir(host, spec)
        python = spec.python if spec.setup != "venv" else f"{base}/envs/venv/bin/python"
        if spec.setup == "venv" and not host.exists(python):
            return Answer(skipped, {"ok": False, "stage": "missing", "error": "setup = venv: no environment yet"})
        shipped = [codeship.ship(host, python, base, t).path for t in (tree, runtime_tree()) if t is not None]
        model_dir = None
        if modelspec.kind(inv.run.model) == "hf":
            root = Path(modelspec.hf_path(inv.run.model))
            model_dir = codeship.ship(host, python, base, codeship.tree_of(root, modeldir.files(inv.run.model))).path
        path = ":".join(filter(None, [shipped[0] if tree else "", spec.env.get("PYTHONPATH", ""), shipped[-1]]))
        return Target(spec.name, roles, python, path, model_dir, lambda: open_host(spec, inv.ssh))
    except DldError as exc:
        return Answer(skipped, {"ok": False, "stage": "host", "error": exc.line()})
    finally:
        host.close()


def before_run(inv: Inventory) -> tuple[list[Answer], list[str]]:
    """`check` and `up --dry-run`: every probe's answer and what keeps the run from starting
    (nothing probed for a built-in preset on the built-in corpus)."""
    if not needed(inv):
        return [], []
    targets, skipped = targets_unstarted(inv, codeship.scan(inv.run, inv.path))
    answers = probe_all(targets, inv) + skipped
    return answers, judge(answers, inv.run.fragments)


def at_up(inv: Inventory, config: ResolvedConfig, runtimes: dict[str, HostRuntime], say: Progress) -> None:
    """After the hosts are set up, before any process starts: the model built as every host's
    processes will build it; OperationError naming the first problem (and how many more)."""
    if not needed(inv):
        return
    from dldctl.hostopen import host_for

    learners = [e for e in config.learners if e.host in runtimes]
    targets = targets_for_run(inv, runtimes, learners, config.syncer.host, lambda n: host_for(inv, n), config.model_dir)
    for t in targets:
        say(t.host, "probe the model")
    answers = probe_all(targets, inv)
    problems = judge(answers, inv.run.fragments)
    if problems:
        more = f" (and {len(problems) - 1} more: `dldctl check` lists them)" if len(problems) > 1 else ""
        raise OperationError(f"{refusal(problems[0])}: {problems[0]}{more}", hint="no process was started")
    for a in answers:
        say(a.target.host, f"model ok: {a.line()}")
