"""The one atomic write (syncer/common/atomic.py) and strict JSON lines: all or nothing, no NaN."""

from __future__ import annotations

import ast
import errno
import json
import math
import stat
from pathlib import Path

import pytest

from syncer.common import jsonl, strictjson
from syncer.common.atomic import atomic_file, atomic_write

ROOT = Path(__file__).resolve().parents[2]


def _strict_loads(text: str) -> object:
    """A parser as strict as jq's or a browser's: NaN, Infinity and -Infinity are errors."""

    def refuse(name: str) -> object:
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


def test_replaces_the_file_whole_with_its_mode_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text("old")
    atomic_write(path, "new", 0o640)
    assert path.read_text() == "new"
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    atomic_write(path, b"\x00bytes")
    assert path.read_bytes() == b"\x00bytes" and stat.S_IMODE(path.stat().st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"), RuntimeError("torch")])
def test_a_failed_write_keeps_the_old_content_and_removes_the_temporary(tmp_path: Path, error: Exception) -> None:
    path = tmp_path / "replica.pt"
    path.write_bytes(b"previous")
    with pytest.raises(type(error)), atomic_file(path) as fh:
        fh.write(b"half of the new")
        raise error
    assert path.read_bytes() == b"previous"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["replica.pt"]


def test_an_unwritable_directory_raises_oserror(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        atomic_write(tmp_path / "missing-dir" / "f", "x")


def test_strict_dumps_writes_non_finite_floats_as_null() -> None:
    doc = {"loss": math.nan, "eta": [math.inf, -math.inf, 1.5], "nested": {"x": (math.nan,)}}
    assert _strict_loads(strictjson.dumps(doc)) == {"loss": None, "eta": [None, None, 1.5], "nested": {"x": [None]}}
    with pytest.raises(ValueError):
        _strict_loads(json.dumps(doc))  # what the standard library writes by default


def test_json_lines_never_contain_nan(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    assert jsonl.append(path, {"t": 1.0, "loss": math.nan, "rate": math.inf, "when": Path("/x")})
    [line] = path.read_text().splitlines()
    assert _strict_loads(line) == {"t": 1.0, "loss": None, "rate": None, "when": "/x"}


# Renames outside the helper that are not file writes: a log's rotation and the compiler's output.
RENAMES_ALLOWED = {"syncer/common/atomic.py", "syncer/common/jsonl.py", "syncer/native/__init__.py"}


def _renames(path: Path) -> list[int]:
    """Lines of os.replace / os.rename calls (the hand-written atomic write's last step)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        fn = node.func if isinstance(node, ast.Call) else None
        receiver = fn.value.id if isinstance(fn, ast.Attribute) and isinstance(fn.value, ast.Name) else ""
        if receiver == "os" and isinstance(fn, ast.Attribute) and fn.attr in ("replace", "rename"):
            out.append(node.lineno)
    return out


@pytest.mark.parametrize(
    "path",
    [p for pkg in ("syncer", "learner", "dldctl", "workload", "bench") for p in sorted((ROOT / pkg).rglob("*.py"))],
    ids=lambda p: str(p.relative_to(ROOT)),
)
def test_every_atomic_write_goes_through_the_one_helper(path: Path) -> None:
    if str(path.relative_to(ROOT)) in RENAMES_ALLOWED:
        return
    assert _renames(path) == [], "write the file with syncer.common.atomic instead of tmp + os.replace"
