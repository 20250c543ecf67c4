"""The native round-step kernel (fused.c): built with the host's C compiler on first use, loaded
with ctypes, and used by syncer/fused.py when every contribution is int4/int8 coded (the Gram
matrices, then merge + Nesterov + quantize + apply in one pass, and the crc32 of the result) and
by the codec to check a push's codes and scales in one read (int4 codes then stay packed).

The C source ships with the package and is compiled where the syncer runs (1-3 s on 2 cores,
once per source version: the library is cached under ~/.cache/dldctl/native/<hash>/), so the
wheel stays pure Python and installs on any learner host. Without a C compiler, or if the build
fails, `load()` returns None and the syncer uses the torch implementation (same results to fp32
rounding, 2-2.7x slower); `DLDCTL_NATIVE=0` turns the kernel off.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import zlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

SOURCE = Path(__file__).with_name("fused.c")
FLAGS = ["-O3", "-std=c11", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math"]
_P = ctypes.c_void_p
_cache: dict[str, Kernel | None] = {}
problem = ""  # why load() returned None, for the syncer's log


class Kernel:
    """ctypes bindings of fused.c, taking torch CPU tensors.

    A contribution is its codes (uint8: int4 packed two a byte as on the wire, or int8 one a
    byte; `packed` tells which) and its fp32 block scales."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        names = ("dld_gram", "dld_check", "dld_publish", "dld_crc32")
        self._gram, self._check, self._publish, self._crc32 = (_bind(lib, n) for n in names)

    @staticmethod
    def _ptrs(tensors: Sequence[torch.Tensor]) -> ctypes.Array[ctypes.c_void_p]:
        for t in tensors:
            assert t.is_contiguous() and t.device.type == "cpu"
        return (_P * len(tensors))(*[t.data_ptr() for t in tensors])

    @staticmethod
    def _flags(packed: Sequence[bool]) -> ctypes.Array[ctypes.c_int32]:
        return (ctypes.c_int32 * len(packed))(*[int(bool(x)) for x in packed])

    def check(self, codes: torch.Tensor, scales: torch.Tensor, qmax: int, packed: bool) -> tuple[bool, bool]:
        """(codes ok, scales ok) of an int4/int8 payload: every nibble of packed int4 codes is a
        code (not 0b1000, -8, which no encoder produces); every scale * qmax is >= 0 and finite."""
        for t in (codes, scales):
            assert t.is_contiguous() and t.device.type == "cpu"
        n = codes.numel() if packed else 0
        rc: int = self._check(scales.data_ptr(), scales.numel(), float(qmax), codes.data_ptr(), n)  # restype c_int
        return not rc & 1, not rc & 2

    def crc32(self, t: torch.Tensor) -> int:
        """zlib.crc32 of a contiguous CPU tensor's bytes (carry-less multiplication: ~5x zlib's speed)."""
        assert t.is_contiguous() and t.device.type == "cpu"
        out = ctypes.c_uint32()
        if self._crc32(t.data_ptr(), t.numel() * t.element_size(), 0, ctypes.byref(out)) != 0:
            return zlib.crc32(t.numpy().data)  # no PCLMULQDQ on this CPU
        return out.value

    def gram(
        self,
        codes: Sequence[torch.Tensor],
        packed: Sequence[bool],
        scales: Sequence[torch.Tensor],
        block: int,
        bounds: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """out (S, M, M) float64, zeroed: the Gram matrix of every segment (fused.c, dld_gram)."""
        rc = self._gram(
            self._ptrs(codes),
            self._flags(packed),
            self._ptrs(scales),
            len(codes),
            block,
            bounds.data_ptr(),
            bounds.numel() - 1,
            out.data_ptr(),
        )
        if rc != 0:
            raise _failure("gram", rc, len(codes), block)

    def publish(
        self,
        codes: Sequence[torch.Tensor],
        packed: Sequence[bool],
        scales: Sequence[torch.Tensor],
        block: int,
        coefs: torch.Tensor,
        bounds: torch.Tensor,
        state: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        lr: float,
        beta: tuple[float, float],
        qmax: int,
        out_scales: torch.Tensor,
        out_codes: torch.Tensor,
    ) -> None:
        """Merge, Nesterov, quantize and apply in place on `state` = (theta, momentum, residual)
        (fused.c, dld_publish); `beta` = (the momentum's decay, its lookahead factor)."""
        theta, momentum, residual = state
        for t in (coefs, bounds, theta, momentum, residual, out_scales, out_codes):
            assert t.is_contiguous() and t.device.type == "cpu"
        rc = self._publish(
            self._ptrs(codes),
            self._flags(packed),
            self._ptrs(scales),
            len(codes),
            block,
            coefs.data_ptr(),
            bounds.data_ptr(),
            theta.numel(),
            theta.data_ptr(),
            momentum.data_ptr(),
            residual.data_ptr(),
            lr,
            beta[0],
            beta[1],
            qmax,
            out_scales.data_ptr(),
            out_codes.data_ptr(),
        )
        if rc != 0:
            raise _failure("publish", rc, len(codes), block)


def _failure(name: str, rc: int, count: int, block: int) -> Exception:
    """The error for a kernel's return code: -1 arguments out of range, -2 no memory."""
    if rc == -2:
        return MemoryError(f"native {name}: no memory for {count} contributions of block {block}")
    return ValueError(f"native {name} refused {count} contributions of block {block}")


# C parameter types as ctypes; every pointer is passed as a plain address (tensor.data_ptr())
_CTYPES: dict[str, type] = {"int32_t": ctypes.c_int32, "int64_t": ctypes.c_int64, "float": ctypes.c_float}
_PROTOTYPE = re.compile(r"^(?:HOT\s+)?int (dld_\w+)\(([^)]*)\)\s*\{", re.M)


def signatures(source: str) -> dict[str, list[type]]:
    """The exported functions' parameter types, read from fused.c: the one place they are declared."""
    return {name: [_ctype(p) for p in params.split(",")] for name, params in _PROTOTYPE.findall(source)}


def _ctype(param: str) -> type:
    if "*" in param:
        return ctypes.c_void_p
    words = [w for w in param.split() if w not in ("const", "restrict")]
    if len(words) != 2 or words[0] not in _CTYPES:
        raise RuntimeError(f"fused.c: no ctypes mapping for parameter {param.strip()!r}")
    return _CTYPES[words[0]]


def _bind(lib: ctypes.CDLL, name: str) -> Any:
    """`lib.name` with its argument types from the C source; every export returns int (0 = ok)."""
    sigs = signatures(SOURCE.read_text())
    if name not in sigs:
        raise RuntimeError(f"fused.c declares no exported int {name}(...)")
    fn = getattr(lib, name)
    fn.restype, fn.argtypes = ctypes.c_int, sigs[name]
    return fn


def load() -> Kernel | None:
    """The kernel, built if needed (cached per source version); None if it cannot be had."""
    global problem
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode()).hexdigest()[:16]
    if digest in _cache:
        return _cache[digest]
    kernel = None
    if os.environ.get("DLDCTL_NATIVE", "1") == "0":
        problem = "turned off (DLDCTL_NATIVE=0)"
    else:
        try:
            path = _build(digest)
            kernel = Kernel(ctypes.CDLL(str(path)), path)
        except (OSError, subprocess.SubprocessError, RuntimeError) as exc:
            problem = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
    _cache[digest] = kernel
    return kernel


def _build(digest: str) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "dldctl" / "native" / digest
    lib = base / "libdldfused.so"
    if lib.exists():
        return lib
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    base.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=base, suffix=".so")
    os.close(fd)
    try:
        proc = subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {(proc.stderr or proc.stdout).strip()[:300]}")
        os.replace(tmp, lib)  # atomic: another syncer building the same source is harmless
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib
