"""Build the project's wheel from the installed packages, to copy to remote hosts.

A wheel is a zip with a `.dist-info` (PEP 427); assembling it from the installed `dldctl`,
`learner` and `syncer` package files works the same for an editable checkout and an installed
release, needs no build backend and no network, and is cached by the content hash.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import zipfile
from pathlib import Path

from dldctl import __version__

PACKAGES = ("dldctl", "learner", "syncer", "workload")
DIST = "dldctl"
# what a learner host needs; the operator-only dependencies are left out on purpose
LEARNER_REQUIRES = ("numpy>=1.24", "pyzmq>=25", "zstandard>=0.21")


def package_files() -> list[tuple[str, Path]]:
    """(archive name, file) of every module and data file of the three packages, sorted."""
    out: list[tuple[str, Path]] = []
    for name in PACKAGES:
        init = importlib.import_module(name).__file__
        if init is None:  # a namespace package (no __init__.py): nothing to anchor the files on
            raise RuntimeError(f"package {name} has no __init__.py; cannot build the learner wheel")
        root = Path(init).resolve().parent
        for path in sorted(root.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".pyc", ".pyo"):
                out.append((f"{name}/{path.relative_to(root).as_posix()}", path))
    return out


def content_hash(files: list[tuple[str, Path]]) -> str:
    h = hashlib.sha256(__version__.encode())
    for arcname, path in files:
        h.update(arcname.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _record_line(arcname: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arcname},sha256={digest},{len(data)}"


def build(cache: Path) -> tuple[Path, str]:
    """(wheel path, content hash); reuses the cached wheel when nothing changed."""
    files = package_files()
    digest = content_hash(files)
    out = cache / digest / f"{DIST}-{__version__}-py3-none-any.whl"
    if out.exists():
        return out, digest
    out.parent.mkdir(parents=True, exist_ok=True)
    info = f"{DIST}-{__version__}.dist-info"
    meta = {
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: dldctl\nVersion: "
        + __version__
        + "\n"
        + "".join(f"Requires-Dist: {r}\n" for r in LEARNER_REQUIRES),
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: dldctl\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    tmp = out.with_suffix(".tmp")
    records = []
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for arcname, path in files:
            data = path.read_bytes()
            zf.writestr(arcname, data)
            records.append(_record_line(arcname, data))
        for arcname, text in meta.items():
            zf.writestr(arcname, text)
            records.append(_record_line(arcname, text.encode()))
        records.append(f"{info}/RECORD,,")
        zf.writestr(f"{info}/RECORD", "\n".join(records) + "\n")
    tmp.replace(out)
    return out, digest
