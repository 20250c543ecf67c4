"""The syncer core driven directly for unit tests: a fake clock, tiny manifests, settings and a
harness that joins learners and pushes real encoded contributions (shared by the test_core* files).
"""

from __future__ import annotations

from typing import Any

import torch

from syncer.common.settings import RunSettings
from syncer.core import Outbox, SyncerCore
from syncer.wire import codec, fragments, quant
from syncer.wire import protocol as P
from syncer.wire.protocol import Message
from workload.gpt import param_shapes

RUN = "run-test"
EMBEDDINGS = {"transformer.wte.weight", "transformer.wpe.weight"}


class Clock:
    """The injected monotonic clock: each reading advances it by `step` (a merge 'takes' time)."""

    def __init__(self, step: float = 0.0) -> None:
        self.t = 0.0
        self.step = step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


def tensor_manifest(name: str = "gpt-tiny") -> list[fragments.TensorSpec]:
    return [
        fragments.TensorSpec(n, s, "embedding" if n in EMBEDDINGS else "dense")
        for n, s in param_shapes(name, block_size=16)
    ]


def small_manifest() -> list[fragments.TensorSpec]:
    return [
        fragments.TensorSpec("emb", (16, 8), "embedding"),
        fragments.TensorSpec("w1", (8, 8)),
        fragments.TensorSpec("b1", (8,)),
        fragments.TensorSpec("w2", (8, 4)),
        fragments.TensorSpec("w3", (4, 4)),
    ]


def make_settings(**changes: Any) -> RunSettings:
    base = dict(
        H=8,
        fragments=2,
        quorum=2,
        tau=2,
        grace_gamma=0.5,
        compression="int4",
        merge="rda",
        liveness_s=3.0,
        heartbeat_s=0.5,
        state_chunk_mb=0.001,
        fleet_scale=False,
        max_queue=256,
        checksum_every=1,
        round_clock="learner",
        max_backlog=0.0,
        outer_lr=0.7,
        outer_momentum=0.9,
    )
    base.update(changes)
    s = RunSettings(**base)
    s.validate()
    return s


def wire(msg: Message) -> Message:
    """Through the real encoder and decoder, as the server would see it."""
    return P.decode(P.encode(msg))


class Harness:
    """A SyncerCore plus helpers that speak for learners."""

    def __init__(
        self,
        settings: RunSettings,
        manifest: list[fragments.TensorSpec] | None = None,
        declared: tuple[str, ...] = ("a", "b", "c"),
        clock_step: float = 0.0,
    ) -> None:
        self.s = settings
        self.seq = 0
        self.clock = Clock(clock_step)
        self.core = SyncerCore(settings, RUN, list(declared), now=0.0, clock=self.clock)
        self.manifest = manifest or small_manifest()
        self.plan = fragments.plan(self.manifest, settings.fragments)
        g = torch.Generator().manual_seed(0)
        self.init_values = [torch.randn(n, generator=g) * 0.02 for n in self.plan.sizes()]
        self.outs: list[Outbox] = []

    def send(self, learner: str, msg: Message, now: float) -> Outbox:
        out = Outbox()
        self.core.handle(learner, wire(msg), now, out)
        self.outs.append(out)
        return out

    def tick(self, now: float) -> Outbox:
        out = Outbox()
        self.core.tick(now, out)
        self.core.settle(now, out)  # as the server does once the updates have left
        self.outs.append(out)
        return out

    def hello(
        self,
        learner: str,
        now: float,
        incarnation: str = "i1",
        run: str = RUN,
        manifest: list[fragments.TensorSpec] | None = None,
        count: int | None = None,
    ) -> Outbox:
        return self.send(
            learner,
            Message(
                "hello",
                {
                    "learner": learner,
                    "incarnation": incarnation,
                    "run": run,
                    "pid": 100,
                    "host": "local",
                    "device": "cpu",
                    "batch_size": 16,
                    "codecs": list(quant.MODES),
                    "manifest": fragments.manifest_to_json(manifest or self.manifest),
                    "fragments": self.s.fragments if count is None else count,
                },
            ),
            now,
        )

    def beat(self, learner: str, now: float, state: str = "running", step: int = 1) -> Outbox:
        return self.send(learner, Message("heartbeat", {"step": step, "tokens": step * 16, "state": state}), now)

    def beat_all(self, now: float) -> None:
        for lid in self.core.fleet.learners:
            self.beat(lid, now)

    def upload_init(self, owner: str, now: float) -> list[Outbox]:
        chunk = self.core.chunk_numel()
        outs = []
        for p, values in enumerate(self.init_values):
            for off in range(0, values.numel(), chunk):
                part = values[off : off + chunk]
                outs.append(
                    self.send(
                        owner,
                        Message(
                            "init",
                            {"fragment": p, "offset": off, "numel": part.numel(), "total": values.numel()},
                            [part.numpy().tobytes()],
                        ),
                        now,
                    )
                )
        return outs

    def join_all(self, learners: tuple[str, ...] = ("a", "b", "c"), now: float = 1.0) -> None:
        for lid in learners:
            self.hello(lid, now)
        self.upload_init(learners[0], now)
        for lid in learners:
            self.beat(lid, now)
        assert self.core.model is not None

    def push(
        self,
        learner: str,
        p: int,
        delta: torch.Tensor,
        now: float,
        c_steps: int = 8,
        c_tokens: int = 128,
        step_time: float = 1.0,
        base_version: int | None = None,
        blob: bytes | None = None,
        last: bool = False,
    ) -> Outbox:
        assert self.core.model is not None
        if base_version is None:
            base_version = self.core.model.versions[p]
        block = quant.wire_block(self.s.compression, self.s.block, self.s.topk_keep)
        blob = codec.encode(delta, self.s.compression, block, self.s.zstd) if blob is None else blob
        self.seq += 1  # a learner's pushes carry increasing sequence numbers (replays are refused)
        return self.send(
            learner,
            Message(
                "push",
                {
                    "fragment": p,
                    "base_version": base_version,
                    "seq": self.seq,
                    "epoch": 1,
                    "c_steps": c_steps,
                    "c_tokens": c_tokens,
                    "c_time": c_steps * step_time,
                    "step_time": step_time,
                    **({"last": True} if last else {}),
                },
                [blob],
            ),
            now,
        )

    def delta(self, p: int, seed: int, scale: float = 1e-3) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed)
        return torch.randn(self.plan.numel(p), generator=g) * scale


def sent_of(out: Outbox, kind: str) -> list[tuple[list[str], Message]]:
    return [(to, m) for to, m in out.sends if m.kind == kind]


def events_of(out: Outbox, kind: str) -> list[dict]:
    return [e for e in out.events if e["kind"] == kind]


def rounds_of(out: Outbox) -> list[dict]:
    return [m for m in out.metrics if m["kind"] == "round"]
