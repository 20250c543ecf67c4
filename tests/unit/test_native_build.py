"""The native kernel as a declared step: its C signatures read from fused.c, built by a real process."""

from __future__ import annotations

import ctypes
import sys

import pytest

from dldctl.lifecycle import kernel
from syncer import native


def test_the_signatures_come_from_the_c_source_and_cover_every_export() -> None:
    sigs = native.signatures(native.SOURCE.read_text())
    assert set(sigs) == {"dld_gram", "dld_check", "dld_publish", "dld_crc32"}
    assert sigs["dld_crc32"] == [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    assert sigs["dld_check"] == [ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int64]
    assert sigs["dld_publish"][11:15] == [ctypes.c_float, ctypes.c_float, ctypes.c_float, ctypes.c_int32]


def test_a_parameter_without_a_ctypes_mapping_is_refused() -> None:
    with pytest.raises(RuntimeError, match="no ctypes mapping for parameter 'double x'"):
        native.signatures("int dld_odd(const float *a, double x) {\n")


def test_the_build_step_runs_in_its_own_process_and_reports_the_library() -> None:
    status = kernel.build()
    assert status.ok, status.detail
    assert status.detail.endswith("libdldfused.so") and "ready" in status.line()


def test_the_build_step_says_why_there_is_no_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DLDCTL_NATIVE", "0")
    off = kernel.build()
    assert not off.ok and "DLDCTL_NATIVE=0" in off.detail and "merges with torch" in off.line()
    missing = kernel.build(python=sys.executable + "-missing")
    assert not missing.ok and "could not run" in missing.detail
