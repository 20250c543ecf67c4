"""Preparing hosts: open them, set up their Python, copy the run's files, report progress.

Per remote host: connect, copy the wheel, set up (skipped when the wheel hash is unchanged),
ship the user's code (`[run] workdir`, dldctl/lifecycle/codeship.py: only what the host lacks),
copy the resolved configuration, the run's model files and that host's keys (0600), and record a
`HostRuntime` that says how to start processes there. The operator's own machine runs from its
own Python and run directory; it gets only the code snapshot.
"""

from __future__ import annotations

import shlex
import sys
from collections.abc import Callable
from pathlib import Path

from dldctl import rundir
from dldctl.errors import RemoteCommandError, SetupError
from dldctl.hostruntime import HostRuntime
from dldctl.hosts import Host, LocalHost
from dldctl.inventory import HostSpec, Inventory
from dldctl.lifecycle import codeship, initmodel, modeldir
from dldctl.rundir import RunDir
from syncer.common.resolved import ResolvedConfig

LIGHT_DEPS = {"zmq": "pyzmq>=25", "zstandard": "zstandard>=0.21", "numpy": "numpy>=1.24"}
# an `hf:` model's learners and syncer build it with these (pyproject's `hf` extra)
HF_DEPS = ("transformers>=4.46", "tokenizers>=0.20")
# best effort: without it the syncer writes final_model.pt alone, says so, and `dldctl export` converts it
OPTIONAL_DEPS = {"safetensors": "safetensors>=0.4"}
# the data's readers (pyproject's `data` extra): a tokenizer, and Parquet
DATA_DEPS = {"tokenizer": "tokenizers>=0.20", "parquet": "pyarrow>=14"}
Progress = Callable[[str, str], None]


def data_deps(model: str, data: str, tokenizer: str) -> tuple[str, ...]:
    """What a host's venv needs beyond the wheel for this model and data: transformers for an
    `hf:` model (modelspec.HF), tokenizers for a tokenizer, pyarrow for Parquet data."""
    deps = list(HF_DEPS) if model.startswith("hf:") else []
    if tokenizer and DATA_DEPS["tokenizer"] not in deps:
        deps.append(DATA_DEPS["tokenizer"])
    if ".parquet" in data:
        deps.append(DATA_DEPS["parquet"])
    return tuple(deps)


def local_runtime(name: str, run: RunDir, tree: codeship.Tree | None = None) -> HostRuntime:
    """This machine: its own Python, the run directory itself, the code snapshot in $DLDCTL_HOME."""
    code = codeship.ship(LocalHost(name), sys.executable, str(rundir.home()), tree).path if tree else ""
    return HostRuntime(name, sys.executable, "", str(run.path), str(run.config), code)


def prepare(
    host: Host,
    spec: HostSpec,
    run: RunDir,
    config: ResolvedConfig,
    wheel: Path,
    digest: str,
    learner_ids: list[str],
    progress: Progress,
    tree: codeship.Tree | None = None,
) -> HostRuntime:
    """Set up one host for this run (idempotent); returns how to start processes on it."""
    if spec.local:
        progress(spec.name, "local: nothing to copy" if tree is None else "local: code snapshot")
        return local_runtime(spec.name, run, tree)
    progress(spec.name, "connect")
    base = base_dir(host, spec)
    progress(spec.name, "copy wheel")
    remote_wheel = f"{base}/wheels/{digest}/{wheel.name}"
    if not host.exists(remote_wheel):
        host.put_file(wheel, remote_wheel, 0o644)
    progress(spec.name, "set up python")
    extra = data_deps(config.run.model, config.run.data, config.run.tokenizer)
    python, site = _setup(host, spec, base, remote_wheel, digest, extra)
    code = ship_code(host, spec, python, base, tree, progress)
    progress(spec.name, "copy config and keys")
    remote_run = f"{base}/runs/{config.run_id}"
    push_run_files(host, run, remote_run, learner_ids, config)
    if spec.name in config.syncer.hosts:  # a syncer shard runs here
        push_syncer_keys(host, run, remote_run, config)
    return HostRuntime(spec.name, python, site, remote_run, f"{remote_run}/config.json", code)


def ship_code(
    host: Host, spec: HostSpec, python: str, base: str, tree: codeship.Tree | None, progress: Progress
) -> str:
    """The workdir's snapshot on the host ("" when the run has none), with a progress line."""
    if tree is None:
        return ""
    progress(spec.name, f"ship workdir ({len(tree.files)} files, {tree.size / (1 << 20):.1f} MB)")
    shipped = codeship.ship(host, python, base, tree)
    if shipped.files_sent:
        progress(spec.name, f"shipped {shipped.files_sent} files ({shipped.bytes_sent / (1 << 20):.1f} MB)")
    return shipped.path


def push_run_files(host: Host, run: RunDir, remote_run: str, learner_ids: list[str], config: ResolvedConfig) -> None:
    """config.json (and the run's init model) plus this host's learner keys and the syncer's public key, all 0600."""
    host.mkdir(f"{remote_run}/keys", 0o700)
    host.put_bytes(run.config.read_bytes(), f"{remote_run}/config.json", 0o600)
    initmodel.push(host, run, remote_run, config)
    modeldir.push(host, run, remote_run, config)
    if config.run.insecure:
        return
    host.put_bytes((run.keys / "syncer.key").read_bytes(), f"{remote_run}/keys/syncer.key", 0o600)
    for lid in learner_ids:
        host.put_bytes((run.keys / f"{lid}.key_secret").read_bytes(), f"{remote_run}/keys/{lid}.key_secret", 0o600)


def push_syncer_keys(host: Host, run: RunDir, remote_run: str, config: ResolvedConfig) -> None:
    """For a syncer on this host: its key pair and every public key it admits (0600). Also
    used by `learner add`: the syncer picks new learners' keys up from its keys dir."""
    if config.run.insecure:
        return
    host.mkdir(f"{remote_run}/keys", 0o700)
    host.put_bytes((run.keys / "syncer.key_secret").read_bytes(), f"{remote_run}/keys/syncer.key_secret", 0o600)
    for public in sorted(run.keys.glob("*.key")):
        host.put_bytes(public.read_bytes(), f"{remote_run}/keys/{public.name}", 0o600)


def base_dir(host: Host, spec: HostSpec) -> str:
    """The host's dldctl directory (`[[hosts]] workdir`, `~` expanded there)."""
    return host.home() if spec.workdir in ("~", "") else _expand(host, spec.workdir)


def _expand(host: Host, path: str) -> str:
    if path.startswith("~"):
        return host.home().rstrip("/") + path[1:]
    return path


def _setup(
    host: Host, spec: HostSpec, base: str, remote_wheel: str, digest: str, extra: tuple[str, ...] = ()
) -> tuple[str, str]:
    """(python, PYTHONPATH) on the host; skipped when this wheel was already set up. `extra`: what
    the run's model needs besides torch (a venv installs it; the host's own Python must have it,
    which the model probe checks)."""
    if spec.setup == "venv":
        return _setup_venv(host, spec, base, remote_wheel, digest, extra)
    site = f"{base}/site/{digest}"
    marker = f"{site}/.dldctl-ok"
    if host.exists(marker):
        return spec.python, site
    _step(
        host,
        spec,
        f"{shlex.quote(spec.python)} -m pip install -q --no-deps --no-compile "
        f"--target {shlex.quote(site)} {shlex.quote(remote_wheel)}",
    )
    missing = _missing_modules(host, spec.python, site)
    if "torch" in missing:
        raise SetupError(
            spec.name,
            f"{spec.python} has no torch",
            hint=f'install torch there, point python = "..." at an environment that has it, '
            f'or set setup = "venv" for [[hosts]] {spec.name}',
        )
    light = [LIGHT_DEPS[m] for m in missing if m in LIGHT_DEPS]
    if light:
        _step(
            host,
            spec,
            f"{shlex.quote(spec.python)} -m pip install -q --target {shlex.quote(site)} "
            + " ".join(shlex.quote(x) for x in light),
        )
    optional = [OPTIONAL_DEPS[m] for m in missing if m in OPTIONAL_DEPS]
    if optional:
        try:
            pip = f"{shlex.quote(spec.python)} -m pip install -q --retries 1 --timeout 15 --target {shlex.quote(site)}"
            host.run(f"{pip} " + " ".join(optional), timeout=300)
        except RemoteCommandError:
            pass  # no index reachable: the run works without it (see OPTIONAL_DEPS)
    host.put_bytes(digest.encode(), marker, 0o644)
    return spec.python, site


def _setup_venv(
    host: Host, spec: HostSpec, base: str, remote_wheel: str, digest: str, extra: tuple[str, ...] = ()
) -> tuple[str, str]:
    env = f"{base}/envs/venv"
    py = f"{env}/bin/python"
    marker = f"{env}/.dldctl-{digest}" + ("-hf" if extra else "")
    if host.exists(marker):
        return py, ""
    if not host.exists(py):
        _step(host, spec, f"{shlex.quote(spec.python)} -m venv {shlex.quote(env)}")
    wanted = (spec.torch, *LIGHT_DEPS.values(), *OPTIONAL_DEPS.values(), *extra)
    deps = " ".join(shlex.quote(x) for x in wanted)
    _step(host, spec, f"{shlex.quote(py)} -m pip install -q {deps}", timeout=3600)
    _step(host, spec, f"{shlex.quote(py)} -m pip install -q --no-deps --force-reinstall {shlex.quote(remote_wheel)}")
    host.put_bytes(digest.encode(), marker, 0o644)
    return py, ""


def _missing_modules(host: Host, python: str, site: str) -> list[str]:
    probe = (
        "import importlib.util as u; print(' '.join(m for m in ('torch','zmq','zstandard','numpy','safetensors') "
        "if u.find_spec(m) is None))"
    )
    result = host.run(f"PYTHONPATH={shlex.quote(site)} {shlex.quote(python)} -c {shlex.quote(probe)}", timeout=120)
    return result.stdout.split()


def _step(host: Host, spec: HostSpec, command: str, timeout: float = 900.0) -> None:
    try:
        host.run(command, timeout=timeout)
    except RemoteCommandError as exc:
        tail = " | ".join(exc.output_tail.strip().splitlines()[-3:])
        raise SetupError(spec.name, f"set-up failed: `{command}` exited {exc.status}: {tail}") from exc


def learners_by_host(config: ResolvedConfig) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for entry in config.learners:
        out.setdefault(entry.host, []).append(entry.id)
    return out


def host_specs(inv: Inventory) -> dict[str, HostSpec]:
    return {h.name: h for h in inv.hosts}
