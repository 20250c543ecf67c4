"""One replica group of the torchft DiLoCo baseline: the learners' model and data, trained by
torchft 0.2.0's fault-tolerant (streaming) DiLoCo.

    REPLICA_GROUP_ID=G TORCHFT_LIGHTHOUSE=http://127.0.0.1:PORT \\
        python bench/torchft_worker.py --config CONFIG.json --out DIR/replica-G

`bench/torchft_diloco.py` launches one of these per replica group (1 rank each) and restarts it
after a kill (TORCHFT_INCARNATION counts the restarts). The set-up follows torchft's own
`train_diloco.py` example and its local_sgd integration tests:

- the workload is the one a learner builds: `build_workload` with learner_index = G, shards =
  replicas, the run's seed (identical init everywhere, so `init_sync=False`); a restarted
  incarnation draws a fresh batch order (data seed + 7919 x incarnation) instead of replaying;
- the group's own TCPStore on 127.0.0.1 (port 0: torchrun is not used, so nothing else hosts it);
- `torchft.Manager(ProcessGroupGloo, use_async_quorum=False, min_replica_size, init_sync=False)`
  with torchft's HTTP checkpoint transport, through which a restarted replica receives the
  model, the inner AdamW state and every fragment's global parameters and outer optimizer from a
  live peer at its first quorum (its only change: it advertises 127.0.0.1, not the hostname);
- `torchft.local_sgd.DiLoCo(sync_every=H)` over `fragments` balanced groups of whole parameter
  tensors (streaming DiLoCo: one fragment every H/fragments inner steps, each fragment every H),
  an outer SGD(outer_lr, momentum, nesterov=True) per fragment, the learners' inner optimizer
  (AdamW, lr and weight decay of the settings, grad clip, `learner.schedule.learning_rate` at
  inner step = committed outer steps x H/fragments + steps since the last sync).

Every event is one JSON line appended to OUT/progress.jsonl (all incarnations): "boot" (the
Manager is up), "start" (first inner step), "sync" (one per fragment sync: committed or not,
healed or not, tokens trained and credited), "eval" (group 0: the held-out loss of its global
model, by `bench.evaluate.eval_loss` on the learners' eval batches, at the first commit after
every `eval_every_s`), "final". The first incarnations wait for the go file (every group's Manager is
up, so the first quorum has them all) before training; a restarted one does not. Tokens credited
at a sync are this incarnation's inner steps
since its previous sync, when the sync committed and this replica did not heal at it (a healed
replica's pseudo-gradient is a copy of its peer's). When the stop file appears, the worker saves
its global model (every fragment's last committed parameters) as OUT/final_model.pt
({"state_dict": ...}, what bench/evaluate.py loads), writes OUT/final.json and exits.
"""

from __future__ import annotations

import time

_PROCESS_T0 = time.time()  # before the heavy imports: a restart's cost includes them

import argparse
import copy
import dataclasses
import json
import os
import sys
from dataclasses import dataclass, fields
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch
from torch import nn
from torch.distributed import TCPStore
from torchft import Manager, ProcessGroupGloo
from torchft.checkpointing import HTTPTransport
from torchft.local_sgd import DiLoCo

from bench.baseline_loop import InnerLoop, Strategy, inner_optimizer, workload
from bench.evaluate import eval_loss
from syncer.common.atomic import atomic_file, atomic_write
from syncer.common.settings import settings_from_dict
from workload import Workload

HOST = "127.0.0.1"
PROGRESS, FINAL, FINAL_MODEL = "progress.jsonl", "final.json", "final_model.pt"
DATA_RESEED = 7_919  # a restarted incarnation's data seed: seed + DATA_RESEED x incarnation


@dataclass
class WorkerConfig:
    """The worker's JSON config (what `bench.torchft_diloco.run_torchft` writes)."""

    settings: dict  # run settings, as for the learners (model, data, seed, lr, H, ...)
    replicas: int  # replica groups (= data shards)
    stop_file: str  # stop (save the final model, exit) once this file exists
    go_file: str = ""  # start training only once this file exists (all groups booted)
    fragments: int = 1  # streaming DiLoCo fragments (H must be a multiple)
    eval_every_s: float = 10.0  # group 0: evaluate its global model about this often
    outer_lr: float = 0.7
    outer_momentum: float = 0.9  # Nesterov
    min_replicas: int = 1  # Manager(min_replica_size=...)
    timeout_s: float = 30.0  # Manager: collectives, should_commit, checkpoint transfer
    quorum_timeout_s: float = 60.0
    connect_timeout_s: float = 10.0
    pg_timeout_s: float = 10.0  # ProcessGroupGloo
    threads: int = 1
    throttle: float = 1.0  # > 1: each step waits (throttle - 1) x its compute, as a learner's host throttle


def load_config(text_or_path: str) -> WorkerConfig:
    """A WorkerConfig from inline JSON or a JSON file; unknown keys are an error."""
    raw = text_or_path.strip()
    data = json.loads(raw if raw.startswith("{") else Path(raw).read_text())
    unknown = set(data) - {f.name for f in fields(WorkerConfig)}
    if unknown:
        raise ValueError(f"unknown torchft_worker config keys {sorted(unknown)}")
    cfg = WorkerConfig(**data)
    cfg.settings = settings_from_dict({k: v for k, v in cfg.settings.items() if k != "name"}).to_dict()
    check_schedule(int(cfg.settings["H"]), cfg.fragments)
    return cfg


def check_schedule(H: int, fragments: int) -> int:
    """Inner steps between two fragment syncs (H / fragments); DiLoCo's own constraints, early."""
    if fragments < 1 or fragments > H or H % fragments:
        raise ValueError(f"torchft DiLoCo needs H a multiple of fragments >= 1 (H={H}, fragments={fragments})")
    return H // fragments


def balanced_fragments(sizes: list[tuple[str, int]], count: int) -> list[list[str]]:
    """Whole tensors into `count` groups, largest first into the lightest group; each group keeps
    model order. Pure and deterministic, so every replica builds the same fragments."""
    if count < 1 or count > len(sizes):
        raise ValueError(f"cannot cut {len(sizes)} tensors into {count} fragments")
    loads = [0] * count
    owner: dict[str, int] = {}
    for name, numel in sorted(sizes, key=lambda item: -item[1]):
        best = min(range(count), key=lambda i: (loads[i], i))
        owner[name] = best
        loads[best] += numel
    return [[name for name, _ in sizes if owner[name] == i] for i in range(count)]


class ParamFragment(nn.Module):
    """A module holding (references to) some of the model's parameters: a DiLoCo fragment."""

    def __init__(self, model: nn.Module, names: list[str]) -> None:
        super().__init__()
        params = dict(model.named_parameters())
        self.names = list(names)
        for i, name in enumerate(self.names):
            self.register_parameter(f"p{i}", params[name])

    def model_names(self) -> dict[str, str]:
        """{this fragment's parameter name: the model's}."""
        return {f"p{i}": name for i, name in enumerate(self.names)}


class LoopbackHTTPTransport(HTTPTransport):
    """torchft's HTTP checkpoint transport, advertising 127.0.0.1 instead of the hostname."""

    def address(self) -> str:
        port = self._server.socket.getsockname()[1]
        return f"http://{HOST}:{port}/checkpoint/"


class DiLoCoSync(Strategy):
    """torchft's DiLoCo: gradients stay local; the outer sync runs inside the inner optimizer's step
    (DiLoCo's hook: every H/fragments steps a quorum, an all-reduce, the outer step)."""

    syncs_in_update = True


class Replica:
    """This replica group's training job."""

    def __init__(self, cfg: WorkerConfig, out: Path) -> None:
        self.cfg, self.s, self.out = cfg, cfg.settings, out
        self.group = int(os.environ.get("REPLICA_GROUP_ID", "0"))
        self.incarnation = int(os.environ.get("TORCHFT_INCARNATION", "0"))
        self.every = check_schedule(int(self.s["H"]), cfg.fragments)
        self.wl = self._build()
        self.inner = inner_optimizer(self.wl.model, self.s)
        self.loop = InnerLoop(
            self.wl, self.inner, DiLoCoSync(self.wl.model), self.s, device=torch.device("cpu"), throttle=cfg.throttle
        )
        sizes = [(n, p.numel()) for n, p in self.wl.model.named_parameters()]
        self.fragments = [ParamFragment(self.wl.model, names) for names in balanced_fragments(sizes, cfg.fragments)]
        self.outer = [
            torch.optim.SGD(f.parameters(), lr=cfg.outer_lr, momentum=cfg.outer_momentum, nesterov=True)
            for f in self.fragments
        ]
        self.store = TCPStore(host_name=HOST, port=0, is_master=True, wait_for_workers=False)
        self.manager = self._manager()
        self.steps = self.tokens_trained = self.tokens_committed = self.pending = 0
        self.healed_at: int | None = None
        self.last_eval = -float("inf")
        self.eval_model: nn.Module | None = None
        self._diloco: DiLoCo | None = None
        self.loss: float | None = None
        self._event(
            "boot",
            boot_s=time.time() - _PROCESS_T0,
            fragment_sizes=[sum(p.numel() for p in f.parameters()) for f in self.fragments],
        )

    def _build(self) -> Workload:
        seed = int(self.s["seed"]) + DATA_RESEED * self.incarnation
        return workload(self.s, self.group, self.cfg.replicas, torch.device("cpu"), seed)

    def _manager(self) -> Manager:
        c = self.cfg
        timeout = timedelta(seconds=c.timeout_s)
        return Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=c.pg_timeout_s)),
            load_state_dict=self._load_state_dict,
            state_dict=self._state_dict,
            min_replica_size=c.min_replicas,
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=c.quorum_timeout_s),
            connect_timeout=timedelta(seconds=c.connect_timeout_s),
            rank=0,
            world_size=1,
            store_addr=HOST,
            store_port=self.store.port,
            lighthouse_addr=os.environ["TORCHFT_LIGHTHOUSE"],
            replica_id=f"torchft_diloco_{self.group}",
            hostname=HOST,
            init_sync=False,
            checkpoint_transport=LoopbackHTTPTransport(timeout=timeout, num_chunks=0),
        )

    # -- what a recovering peer receives (DiLoCo adds each fragment's global state itself) ------
    def _state_dict(self) -> dict[str, Any]:
        return {"model": self.wl.model.state_dict(), "inner_optim": self.inner.state_dict()}

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        self.wl.model.load_state_dict(state["model"])
        self.inner.load_state_dict(state["inner_optim"])
        self.healed_at = self.manager.current_step()  # the step the live peers are at
        self._event("heal", manager_step=self.healed_at)

    # -- training -----------------------------------------------------------------------------
    def run(self) -> int:
        """Train until the stop file appears; then save the global model and exit."""
        if self.group == 0 and self.incarnation == 0:
            self._evaluate()
        stop = Path(self.cfg.stop_file)
        while self.cfg.go_file and not Path(self.cfg.go_file).exists() and not stop.exists():
            time.sleep(0.05)
        with DiLoCo(
            self.manager,
            self.fragments,
            self.inner,
            self.outer,
            sync_every=int(self.s["H"]),
            backup_device=torch.device("cpu"),
            pin_memory=False,
        ) as self._diloco:
            while not stop.exists():
                self._train_step()
                if self.steps == 1:
                    self._event("start", manager_step=self.manager.current_step())
        self._finish()
        return 0

    def _train_step(self) -> None:
        """One inner step at the learning rate of inner step committed outer steps x H/fragments +
        steps since the last sync; every H/fragments steps it holds a fragment's sync."""
        before = self.manager.current_step()
        step = self.loop.step(self.loop.lr(before * self.every + self.steps % self.every))
        self.steps += 1
        self.tokens_trained += step.tokens
        self.pending += step.tokens
        self.loss = float(step.loss.detach())
        if self.steps % self.every == 0:
            self._after_sync(before)

    def _after_sync(self, before: int) -> None:
        """Account one fragment sync: did it commit, did this replica heal at it, what it credits."""
        after, healed_at = self.manager.current_step(), self.healed_at
        self.healed_at = None
        committed = after == (healed_at if healed_at is not None else before) + 1
        credited = self.pending if committed and healed_at is None else 0
        self.pending = 0
        self.tokens_committed += credited
        self._event(
            "sync",
            manager_step=after,
            committed=committed,
            healed=healed_at is not None,
            credited=credited,
            participants=self.manager.num_participants(),
            batches_committed=self.manager.batches_committed(),
            loss=self.loss,
        )
        if self.group == 0 and committed and time.time() - self.last_eval >= self.cfg.eval_every_s:
            self._evaluate()

    # -- the global model ---------------------------------------------------------------------
    def global_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state with every fragment's last committed (global) parameters."""
        state = {k: v.detach().clone() for k, v in self.wl.model.state_dict().items()}
        for fragment, sync in zip(self.fragments, self._diloco_fragments()):
            for local, name in fragment.model_names().items():
                state[name] = sync.original_parameters[local].detach().clone()
        if "lm_head.weight" in state and "transformer.wte.weight" in state:
            state["lm_head.weight"] = state["transformer.wte.weight"]  # tied: the same tensor
        return state

    def _diloco_fragments(self) -> list[Any]:
        return self._diloco._fragments if self._diloco is not None else []

    def _evaluate(self) -> None:
        if self.eval_model is None:
            self.eval_model = copy.deepcopy(self.wl.model)
        wl = dataclasses.replace(self.wl, model=self.eval_model)
        state = self.global_state_dict() if self._diloco_fragments() else self.wl.model.state_dict()
        t0 = time.perf_counter()
        value = eval_loss(state, self.s, wl)
        self.last_eval = time.time()
        self._event("eval", eval_loss=value, manager_step=self.manager.current_step(), eval_s=time.perf_counter() - t0)

    def _finish(self) -> None:
        with atomic_file(self.out / FINAL_MODEL) as fh:
            torch.save({"state_dict": self.global_state_dict()}, fh)
        doc = self._record("final")
        atomic_write(self.out / FINAL, json.dumps(doc) + "\n")
        self._append(doc)

    # -- reporting ----------------------------------------------------------------------------
    def _record(self, event: str, **extra: Any) -> dict[str, Any]:
        return {
            "event": event,
            "time": time.time(),
            "group": self.group,
            "incarnation": self.incarnation,
            "steps": self.steps,
            "tokens_trained": self.tokens_trained,
            "tokens_committed": self.tokens_committed,
            "manager_step": self.manager.current_step() if hasattr(self, "manager") else 0,
            **extra,
        }

    def _event(self, event: str, **extra: Any) -> None:
        self._append(self._record(event, **extra))

    def _append(self, doc: dict[str, Any]) -> None:
        """One line, one write() in append mode."""
        with open(self.out / PROGRESS, "a") as fh:
            fh.write(json.dumps(doc) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="JSON text or a JSON file (see WorkerConfig)")
    parser.add_argument("--out", required=True, type=Path, help="this replica group's directory")
    args = parser.parse_args(argv)
    cfg = load_config(args.config)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, cfg.threads))
    replica = Replica(cfg, args.out)
    try:
        return replica.run()
    finally:
        replica.manager.shutdown(wait=False)


if __name__ == "__main__":
    sys.exit(main())
