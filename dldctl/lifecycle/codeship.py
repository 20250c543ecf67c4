"""The user's code directory (`[run] workdir`) on every host that runs a learner or a syncer shard.

    scan   this machine's tree: each file's path, size, mode and sha256, without what never
           belongs in a run (.git/, __pycache__/, virtual environments, *.pyc, and the globs of
           the tree's own `.dldctlignore`); a tree over `[run] workdir_max_mb` is refused with
           its largest files named
    ship   the tree onto a host as an immutable snapshot `<base>/code/<digest>/`, which every
           process of the run puts first on its import path (HostRuntime.code). A host that has
           the snapshot gets nothing; otherwise only the files whose content it lacks travel
           (its blob store `<base>/code/blobs/<sha256>` keeps every file once), as one tar that a
           small script of the host's Python checks and assembles by hard links

A snapshot, not the live directory: every learner, restarted or not, and the syncer import the
code as it was at `up`, on every host alike; `up --resume` ships the directory as it is then.
"""

from __future__ import annotations

import fnmatch
import hashlib
import io
import json
import os
import shlex
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path

from dldctl.errors import ConfigError, SetupError
from dldctl.hosts import Host
from syncer.common.settings import RunSettings

IGNORE_FILE = ".dldctlignore"
NEVER_DIRS = {".git", ".hg", ".svn", "__pycache__", ".venv", "venv", ".mypy_cache", ".pytest_cache", ".ruff_cache"}
NEVER_DIRS |= {".tox", ".nox", "node_modules", ".ipynb_checkpoints", ".eggs"}
NEVER_SUFFIXES = (".pyc", ".pyo")
FIX = f"list what the processes do not need in {IGNORE_FILE} (one glob a line), or raise [run] workdir_max_mb"


@dataclass(frozen=True)
class Entry:
    """One file of the tree: its path inside the tree (posix), content hash, size, executable bit."""

    path: str
    sha256: str
    size: int
    executable: bool


@dataclass(frozen=True)
class Tree:
    """A scanned code directory: where it is here, its files, and the digest that names it."""

    root: Path
    files: tuple[Entry, ...]

    @property
    def digest(self) -> str:
        """sha256 of the listing (paths, contents, modes): equal trees, equal snapshots."""
        listing = [(e.path, e.sha256, e.executable) for e in self.files]
        return hashlib.sha256(json.dumps(listing).encode()).hexdigest()[:32]

    @property
    def size(self) -> int:
        return sum(e.size for e in self.files)

    def manifest(self) -> dict[str, object]:
        """What the host's script assembles: [path, sha256, executable] per file."""
        return {"digest": self.digest, "files": [[e.path, e.sha256, e.executable] for e in self.files]}


def ignore_patterns(root: Path) -> list[str]:
    """The globs of `root/.dldctlignore` (blank lines and # comments skipped)."""
    try:
        lines = (root / IGNORE_FILE).read_text().splitlines()
    except OSError:
        return []
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def ignored(rel: str, is_dir: bool, patterns: list[str]) -> bool:
    """Whether the path `rel` (posix, inside the tree) is left out. Pure."""
    name = rel.rsplit("/", 1)[-1]
    if is_dir and name in NEVER_DIRS:
        return True
    if not is_dir and name.endswith(NEVER_SUFFIXES):
        return True
    for pattern in patterns:
        dir_only = pattern.endswith("/")
        glob = pattern.rstrip("/").lstrip("/")
        if dir_only and not is_dir:
            continue
        if fnmatch.fnmatch(rel, glob) or ("/" not in glob and fnmatch.fnmatch(name, glob)):
            return True
    return False


def file_hash(path: Path) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size


def walk(root: Path) -> list[Entry]:
    """Every file of the tree that is not ignored, sorted by path (symlinked directories are not
    followed; a symlinked file travels as its content)."""
    patterns = ignore_patterns(root)
    out: list[Entry] = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        rel_dir = here.relative_to(root).as_posix()
        prefix = "" if rel_dir == "." else rel_dir + "/"
        dirnames[:] = sorted(d for d in dirnames if not ignored(prefix + d, True, patterns))
        for name in sorted(filenames):
            rel, path = prefix + name, here / name
            if ignored(rel, False, patterns) or not path.is_file():
                continue
            digest, size = file_hash(path)
            out.append(Entry(rel, digest, size, bool(path.stat().st_mode & stat.S_IXUSR)))
    return sorted(out, key=lambda e: e.path)


def tree_of(root: Path, paths: list[Path]) -> Tree:
    """A tree of chosen files of `root` (its top level), e.g. an `hf:` model's config and tokenizer."""
    entries = []
    for path in sorted(paths):
        digest, size = file_hash(path)
        entries.append(Entry(path.relative_to(root).as_posix(), digest, size, False))
    return Tree(root, tuple(entries))


def scan(run: RunSettings, inventory: str) -> Tree | None:
    """The run's workdir, scanned and held to its size limit; None when the run names none."""
    if not run.workdir:
        return None
    root = Path(run.workdir)
    if not root.is_dir():
        raise ConfigError(inventory, "run.workdir", f"{root}: no such directory", "point workdir at your code")
    tree = Tree(root, tuple(walk(root)))
    limit = int(run.workdir_max_mb * (1 << 20))
    if tree.size > limit:
        big = sorted(tree.files, key=lambda e: -e.size)[:3]
        names = ", ".join(f"{e.path} ({e.size / (1 << 20):.1f} MB)" for e in big)
        raise ConfigError(
            inventory,
            "run.workdir",
            f"{root} holds {tree.size / (1 << 20):.1f} MB in {len(tree.files)} files, over workdir_max_mb = "
            f"{run.workdir_max_mb:g} (largest: {names})",
            FIX,
        )
    return tree


# The host's side, run by its own Python: `have` answers which blobs it lacks (or that the
# snapshot is there); `make` checks the blobs sent, stores them and assembles the snapshot in a
# temporary directory renamed into place, so a snapshot with its marker is always whole.
HOST_SCRIPT = r"""
import hashlib, json, os, shutil, sys, tarfile
mode, code, digest = sys.argv[1], sys.argv[2], sys.argv[3]
blobs, snap = os.path.join(code, "blobs"), os.path.join(code, digest)
marker = os.path.join(snap, ".dldctl-code")
files = json.loads(sys.stdin.read())["files"]
if mode == "have":
    there = os.path.exists(marker)
    have = set(os.listdir(blobs)) if os.path.isdir(blobs) else set()
    print(json.dumps({"snapshot": there, "missing": [] if there else sorted({s for _, s, _ in files} - have)}))
    sys.exit(0)
os.makedirs(blobs, exist_ok=True)
if len(sys.argv) > 4:
    tarpath = sys.argv[4]
    with tarfile.open(tarpath) as tf:
        for member in tf.getmembers():
            data = tf.extractfile(member).read()
            if hashlib.sha256(data).hexdigest() != member.name:
                os.remove(tarpath)
                sys.exit("blob " + member.name + " arrived damaged")
            tmp = os.path.join(blobs, member.name + ".part" + str(os.getpid()))
            with open(tmp, "wb") as f:
                f.write(data)
            os.chmod(tmp, 0o444)
            os.replace(tmp, os.path.join(blobs, member.name))
    os.remove(tarpath)
if not os.path.exists(marker):
    tmpdir = snap + ".part" + str(os.getpid())
    shutil.rmtree(tmpdir, ignore_errors=True)
    for path, sha, executable in files:
        dst = os.path.join(tmpdir, *path.split("/"))
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        if executable:
            shutil.copyfile(os.path.join(blobs, sha), dst)
            os.chmod(dst, 0o755)
            continue
        try:
            os.link(os.path.join(blobs, sha), dst)
        except OSError:
            shutil.copyfile(os.path.join(blobs, sha), dst)
    open(os.path.join(tmpdir, ".dldctl-code"), "w").write(digest + "\n")
    try:
        os.rename(tmpdir, snap)
    except OSError:
        shutil.rmtree(tmpdir, ignore_errors=True)
        if not os.path.exists(marker):
            raise
print(json.dumps({"snapshot": True}))
"""


@dataclass(frozen=True)
class Shipped:
    """Where the snapshot is on the host, and what this shipment sent (0 files: it was there)."""

    path: str
    files_sent: int
    bytes_sent: int


def _script(host: Host, python: str, args: list[str], manifest: bytes, timeout: float) -> dict[str, object]:
    """Run the host's side; its one JSON line, or SetupError with the script's own last words."""
    command = " ".join(shlex.quote(a) for a in [python, "-c", HOST_SCRIPT, *args])
    result = host.run(command, input=manifest, timeout=timeout, check=False)
    if result.status != 0:
        tail = " | ".join((result.stderr or result.stdout).strip().splitlines()[-2:])
        raise SetupError(host.name, f"shipping the workdir failed: {tail or f'exit {result.status}'}")
    try:
        out: dict[str, object] = json.loads(result.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise SetupError(host.name, f"shipping the workdir: unexpected answer {result.stdout[-200:]!r}") from None
    return out


def _tar(tree: Tree, wanted: set[str]) -> bytes:
    """The files whose content the host lacks, each once, named by its sha256."""
    buf, sent = io.BytesIO(), set()
    with tarfile.open(fileobj=buf, mode="w") as tf:
        for e in tree.files:
            if e.sha256 in wanted and e.sha256 not in sent:
                sent.add(e.sha256)
                tf.add(str(tree.root / e.path), arcname=e.sha256, recursive=False)
    return buf.getvalue()


def ship(host: Host, python: str, base: str, tree: Tree, timeout: float = 600.0) -> Shipped:
    """The tree as a snapshot under `base`/code on `host` (its Python runs the host's side)."""
    code = f"{base.rstrip('/')}/code"
    snap = f"{code}/{tree.digest}"
    manifest = json.dumps(tree.manifest()).encode()
    host.mkdir(code, 0o755)
    answer = _script(host, python, ["have", code, tree.digest], manifest, timeout)
    if answer.get("snapshot"):
        return Shipped(snap, 0, 0)
    listed = answer.get("missing")
    missing = {str(s) for s in listed} if isinstance(listed, list) else set()
    args = ["make", code, tree.digest]
    payload = b""
    if missing:
        payload = _tar(tree, missing)
        remote_tar = f"{code}/incoming-{tree.digest}.tar"
        host.put_bytes(payload, remote_tar, 0o600)
        args.append(remote_tar)
    _script(host, python, args, manifest, timeout)
    return Shipped(snap, len(missing), len(payload))
