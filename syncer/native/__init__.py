"""The native round-step kernel (fused.c): built with the host's C compiler on first use, loaded
with ctypes, and used by syncer/fused.py when every contribution is int4/int8 coded.

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
    """ctypes bindings of fused.c, taking torch CPU tensors."""

    def __init__(self, lib: ctypes.CDLL, path: Path) -> None:
        self.path = path
        self._gram, self._unpack4, self._publish = (_bind(lib, n) for n in ("dld_gram", "dld_unpack4", "dld_publish"))

    @staticmethod
    def _ptrs(tensors: Sequence[torch.Tensor]) -> ctypes.Array[ctypes.c_void_p]:
        for t in tensors:
            assert t.is_contiguous() and t.device.type == "cpu"
        return (_P * len(tensors))(*[t.data_ptr() for t in tensors])

    def unpack4(self, raw: bytearray, offset: int, nblocks: int, block: int, codes: torch.Tensor) -> bool:
        """int4 codes at raw[offset:] -> int8 codes (read in place); False if a nibble is -8."""
        assert codes.is_contiguous() and codes.dtype == torch.int8 and codes.numel() >= nblocks * block
        assert isinstance(raw, bytearray) and len(raw) >= offset + nblocks * block // 2
        address = ctypes.addressof((ctypes.c_char * len(raw)).from_buffer(raw))
        rc: int = self._unpack4(address + offset, nblocks, block, codes.data_ptr())  # restype c_int
        return rc == 0

    def gram(
        self,
        codes: Sequence[torch.Tensor],
        scales: Sequence[torch.Tensor],
        block: int,
        bounds: torch.Tensor,
        out: torch.Tensor,
    ) -> None:
        """out (S, M, M) float64, zeroed: the Gram matrix of every segment (fused.c, dld_gram)."""
        rc = self._gram(
            self._ptrs(codes),
            self._ptrs(scales),
            len(codes),
            block,
            bounds.data_ptr(),
            bounds.numel() - 1,
            out.data_ptr(),
        )
        if rc != 0:
            raise ValueError(f"native gram refused {len(codes)} contributions of block {block}")

    def publish(
        self,
        codes: Sequence[torch.Tensor],
        scales: Sequence[torch.Tensor],
        block: int,
        coefs: torch.Tensor,
        bounds: torch.Tensor,
        theta: torch.Tensor,
        momentum: torch.Tensor,
        residual: torch.Tensor,
        lr: float,
        beta: float,
        qmax: int,
        out_scales: torch.Tensor,
        out_codes: torch.Tensor,
    ) -> None:
        """Merge, Nesterov, quantize and apply in place (fused.c, dld_publish)."""
        for t in (coefs, bounds, theta, momentum, residual, out_scales, out_codes):
            assert t.is_contiguous() and t.device.type == "cpu"
        rc = self._publish(
            self._ptrs(codes),
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
            beta,
            qmax,
            out_scales.data_ptr(),
            out_codes.data_ptr(),
        )
        if rc != 0:
            raise ValueError(f"native publish refused block {block}")


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
