"""Balanced tensor fragmentation: a pure, deterministic function of parameter shapes and P.

Fragments are sets of whole tensors (or row ranges of a tensor larger than the ideal fragment
size, split along dim 0), packed greedily: largest piece first into the currently lightest
fragment. Every learner and the syncer compute the same plan from the same manifest, so a
fragment travels as one flat fp32 vector: its pieces concatenated in model order.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

KINDS = ("dense", "embedding")


@dataclass(frozen=True)
class TensorSpec:
    """One parameter tensor of the model: name, shape, and whether it is an embedding table."""

    name: str
    shape: tuple[int, ...]
    kind: str = "dense"

    @property
    def numel(self) -> int:
        return math.prod(self.shape) if self.shape else 1

    @property
    def row(self) -> int:
        """Elements per index of dim 0."""
        return math.prod(self.shape[1:]) if len(self.shape) > 1 else 1


@dataclass(frozen=True)
class Piece:
    """Rows [start, stop) of tensor `name` (whole tensor: 0..shape[0]), at `offset` in its fragment."""

    name: str
    index: int  # position of the tensor in the manifest
    start: int
    stop: int
    row: int
    kind: str
    offset: int = 0

    @property
    def numel(self) -> int:
        return (self.stop - self.start) * self.row


@dataclass(frozen=True)
class FragmentPlan:
    """P fragments, each an ordered tuple of pieces; the layout of every flat fragment vector."""

    fragments: tuple[tuple[Piece, ...], ...]

    @property
    def count(self) -> int:
        return len(self.fragments)

    def numel(self, p: int) -> int:
        return sum(piece.numel for piece in self.fragments[p])

    def sizes(self) -> list[int]:
        return [self.numel(p) for p in range(self.count)]

    def imbalance(self) -> float:
        """max/min fragment size (1.0 = perfectly balanced)."""
        sizes = self.sizes()
        return max(sizes) / max(1, min(sizes))

    def segments(self, p: int) -> list[tuple[int, int, str]]:
        """(offset, numel, kind) of each piece of fragment p: the unit of the per-tensor merge."""
        return [(piece.offset, piece.numel, piece.kind) for piece in self.fragments[p]]

    def gather(self, p: int, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Fragment p of `tensors` as one new flat fp32 vector (on the tensors' device)."""
        parts = [_rows(tensors[piece.name], piece).reshape(-1) for piece in self.fragments[p]]
        return torch.cat(parts).to(torch.float32)

    def scatter(self, p: int, flat: torch.Tensor, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy a flat fragment vector back into `tensors` (in place, any device)."""
        for piece in self.fragments[p]:
            target = _rows(tensors[piece.name], piece)
            src = flat[piece.offset : piece.offset + piece.numel]
            target.copy_(src.view(target.shape))


def _rows(t: torch.Tensor, piece: Piece) -> torch.Tensor:
    return t if t.dim() == 0 else t[piece.start : piece.stop]


def _pieces(specs: Sequence[TensorSpec], ideal: float) -> list[Piece]:
    """Whole tensors, or even row ranges of tensors bigger than the ideal fragment size."""
    out: list[Piece] = []
    for index, spec in enumerate(specs):
        rows = spec.shape[0] if spec.shape else 1
        splits = 1
        if spec.numel > ideal and rows > 1:
            splits = min(rows, math.ceil(spec.numel / ideal))
        bounds = [round(i * rows / splits) for i in range(splits + 1)]
        for start, stop in itertools.pairwise(bounds):
            out.append(Piece(spec.name, index, start, stop, spec.row, spec.kind))
    return out


def plan(specs: Sequence[TensorSpec], count: int) -> FragmentPlan:
    """Balanced fragmentation of `specs` into `count` fragments (deterministic)."""
    if count < 1:
        raise ValueError(f"fragments must be >= 1, got {count}")
    if len(specs) < count:
        raise ValueError(f"cannot cut {len(specs)} parameter tensors into {count} fragments")
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError("parameter names must be unique")
    for spec in specs:
        if spec.kind not in KINDS:
            raise ValueError(f"tensor {spec.name}: kind must be one of {KINDS}")
    total = sum(s.numel for s in specs)
    pieces = _pieces(specs, total / count)
    # largest first; ties broken by model order so the plan is a pure function of the manifest
    order = sorted(pieces, key=lambda pc: (-pc.numel, pc.index, pc.start))
    loads = [0] * count
    bins: list[list[Piece]] = [[] for _ in range(count)]
    for piece in order:
        target = min(range(count), key=lambda i: (loads[i], i))
        bins[target].append(piece)
        loads[target] += piece.numel
    return FragmentPlan(tuple(_layout(b) for b in bins))


def _layout(pieces: list[Piece]) -> tuple[Piece, ...]:
    """Pieces of one fragment in model order, with their offsets in the flat vector."""
    offset = 0
    out = []
    for piece in sorted(pieces, key=lambda pc: (pc.index, pc.start)):
        out.append(Piece(piece.name, piece.index, piece.start, piece.stop, piece.row, piece.kind, offset))
        offset += piece.numel
    return tuple(out)


def manifest_to_json(specs: Sequence[TensorSpec]) -> list[list[str | list[int]]]:
    """A JSON-ready manifest: [[name, shape, kind], ...]."""
    return [[s.name, list(s.shape), s.kind] for s in specs]


def manifest_from_json(data: object) -> list[TensorSpec]:
    """Inverse of `manifest_to_json`; raises ValueError on anything malformed."""
    if not isinstance(data, list) or not data:
        raise ValueError("manifest must be a non-empty list")
    out = []
    for item in data:
        if not (isinstance(item, list) and len(item) == 3 and isinstance(item[0], str)):
            raise ValueError(f"bad manifest entry {item!r}")
        name, shape, kind = item
        if not (isinstance(shape, list) and all(isinstance(d, int) and 0 <= d < 1 << 40 for d in shape)):
            raise ValueError(f"bad shape for {name}: {shape!r}")
        if kind not in KINDS:
            raise ValueError(f"bad kind for {name}: {kind!r}")
        out.append(TensorSpec(name, tuple(shape), kind))
    return out
