"""Model files a new run can start from (`[run] init_from`), as `dldctl up` checks them and the
learners read them (a leaf: torch is imported only where tensors are made).

Accepted sources:

    final_model.pt   what `dldctl down` exports (syncer/checkpoint.py `export_model`):
                     {"state_dict": {parameter name: fp32 tensor}, "outer_steps", "versions", "run_id",
                     "tokens_merged", "held_out_loss" (the last two since the safetensors export)};
                     parameters only (no buffers), a tied weight once (GPT: no `lm_head.weight`)
    a state dict     {name: tensor}, e.g. `torch.save(model.state_dict(), path)`
    X.safetensors    a safetensors file (`dldctl export`'s model.safetensors, a Hugging Face save)
    a directory      a Hugging Face `save_pretrained` directory: model.safetensors, or
                     model.safetensors.index.json and its shards; names as in the model's
                     state_dict(), a tied lm_head absent; bf16/fp16 tensors are cast at load

`unwrap` (pure) tells the torch layouts apart and checks that what it holds is tensors; `read` is
the one `torch.load` (`weights_only=True`: a file can hold tensors, never code), or reads
safetensors with torch alone (`torch.frombuffer` over the file, per its header: a learner host
needs no safetensors package). `scan` reads safetensors headers without torch (8-byte
little-endian length, then JSON), so the operator checks and copies such a source with no torch;
`write_single` makes the run's one-file copy (shards merged). The run directory of every host
holds its copy as `copy_name(init_from)`: `INIT_MODEL`, or `INIT_SAFETENSORS` for a safetensors
source, named in config.json relative to that file. `dldctl export` reads final_model.pt through
`read` too, to write the safetensors export (syncer/common/modelexport.py) of a run whose syncer
could not.
"""

from __future__ import annotations

import json
import mmap
import shutil
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

INIT_MODEL = "init_model.pt"  # the copy in the run directory, on every host (a torch source)
INIT_SAFETENSORS = "init_model.safetensors"  # the same, for a safetensors source (one file, shards merged)
STATE_DICT = "state_dict"  # the key of the tensors in a file `dldctl down` exported
WEIGHTS = "model.safetensors"  # save_pretrained's names in a directory
INDEX = "model.safetensors.index.json"
MAX_HEADER = 100 << 20  # the safetensors library's own bound on a header
# safetensors dtype -> (torch dtype name, bytes per element)
DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
}


class ModelFileError(ValueError):
    """A model file that cannot start a run; the message says why (the caller adds the path)."""


@dataclass(frozen=True)
class ModelFile:
    """The tensors of a model file, and where they came from when `dldctl down` wrote it."""

    tensors: dict[str, Any]  # name -> torch.Tensor (on the CPU)
    exported: bool = False  # `dldctl down`'s layout: parameters only
    run_id: str | None = None
    outer_steps: int | None = None
    tokens_merged: int | None = None
    held_out_loss: float | None = None  # the syncer's evaluation of these weights, when it had one
    format: str = "torch"  # or "safetensors"

    def origin(self) -> str:
        """'from run X at outer step S', or what the file is when no run wrote it."""
        if not self.exported:
            return "safetensors weights" if self.format == "safetensors" else "a plain state dict"
        run = self.run_id if self.run_id is not None else "?"
        step = self.outer_steps if self.outer_steps is not None else "?"
        return f"from run {run} at outer step {step}"


def unwrap(obj: Any, is_tensor: Callable[[Any], bool]) -> ModelFile:
    """The tensors of a loaded file (either layout); ModelFileError says what is wrong. Pure."""
    if not isinstance(obj, dict):
        raise ModelFileError(f"holds a {type(obj).__name__}, not a state dict ({{name: tensor}})")
    exported = isinstance(obj.get(STATE_DICT), dict)
    tensors = obj[STATE_DICT] if exported else obj
    where = f"its {STATE_DICT!r}" if exported else "it"
    if not tensors:
        raise ModelFileError(f"{where} holds no tensors")
    for name, value in tensors.items():
        if not isinstance(name, str):
            raise ModelFileError(f"{where} has a key {name!r} that is not a tensor name")
        if not is_tensor(value):
            raise ModelFileError(f"{where} maps {name!r} to a {type(value).__name__}, not a tensor")
    if not exported:
        return ModelFile(dict(tensors))
    run_id, steps, merged, loss = (obj.get(k) for k in ("run_id", "outer_steps", "tokens_merged", "held_out_loss"))
    return ModelFile(
        dict(tensors),
        exported=True,
        run_id=run_id if isinstance(run_id, str) else None,
        outer_steps=_int(steps),
        tokens_merged=_int(merged),
        held_out_loss=float(loss) if isinstance(loss, (int, float)) and not isinstance(loss, bool) else None,
    )


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def read(path: Path | str) -> ModelFile:
    """Load a model file on the CPU, tensors only; ModelFileError (one line, naming the file)."""
    import torch

    if is_safetensors(path):
        return read_safetensors(scan(path))

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ModelFileError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ModelFileError(f"{path}: is a directory, not a model file") from None
    except OSError as exc:
        raise ModelFileError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    except Exception as exc:  # torch.load of arbitrary bytes raises nearly anything
        raise ModelFileError(f"{path}: {load_failure(exc)}") from None
    try:
        return unwrap(obj, lambda v: isinstance(v, torch.Tensor))
    except ModelFileError as exc:
        raise ModelFileError(f"{path}: {exc}") from None


def load_failure(exc: BaseException) -> str:
    """Why torch.load(weights_only=True) failed, in one line (its own message is a page)."""
    text = str(exc)
    marker = "WeightsUnpickler error:"
    if marker in text:
        cause = text.split(marker, 1)[1].strip().split("\n")[0].split(". ")[0].strip()
        if cause.startswith("Unsupported global"):
            return (
                f"holds pickled objects, not only tensors ({cause[:160]}); "
                "save a state dict: torch.save(model.state_dict(), path)"
            )
        return f"not a torch file (unpickling failed: {cause[:160]})"
    if isinstance(exc, EOFError):
        return "not a torch file (it ends early: empty or cut off)"
    first = text.strip().split("\n")[0][:160]
    return f"not a torch file ({type(exc).__name__}{': ' + first if first else ''})"


# --------------------------------------------------------------------------- safetensors


@dataclass(frozen=True)
class Entry:
    """One tensor of a safetensors file, by its header: where its bytes are, what they are."""

    dtype: str  # the safetensors name: F32, BF16, ...
    shape: tuple[int, ...]
    file: Path
    start: int  # absolute byte offsets in `file`
    end: int


@dataclass(frozen=True)
class Safetensors:
    """A safetensors source (a file, or a directory's file or shards), read by its headers only."""

    source: Path
    files: tuple[Path, ...]
    entries: dict[str, Entry]
    metadata: dict[str, str]  # the (first) file's __metadata__

    def describe(self) -> str:
        shards = f" in {len(self.files)} shards" if len(self.files) > 1 else ""
        return f"{len(self.entries)} safetensors tensors{shards}"


def is_safetensors(path: Path | str) -> bool:
    """Whether `path` is read as safetensors: a .safetensors file, or a directory (save_pretrained)."""
    p = Path(path).expanduser()
    return p.suffix == ".safetensors" or p.is_dir()


def copy_name(source: Path | str) -> str:
    """The name of the run directory's copy of init_from `source`."""
    return INIT_SAFETENSORS if is_safetensors(source) else INIT_MODEL


def scan(path: Path | str) -> Safetensors:
    """The tensors of a .safetensors file or a save_pretrained directory, from their headers (no
    torch, no tensor bytes read); ModelFileError (one line, naming the file) for anything amiss."""
    path = Path(path).expanduser()
    if not path.is_dir():
        entries, meta = header(path)
        return Safetensors(path, (path,), entries, meta)
    if (path / WEIGHTS).is_file():
        entries, meta = header(path / WEIGHTS)
        return Safetensors(path, (path / WEIGHTS,), entries, meta)
    if (path / INDEX).is_file():
        return _sharded(path, path / INDEX)
    raise ModelFileError(
        f"{path}: no weights in the directory (neither {WEIGHTS} nor {INDEX}); "
        "save the model there with model.save_pretrained(dir) (safetensors)"
    )


def _sharded(directory: Path, index: Path) -> Safetensors:
    """The shards an index maps every tensor to, each header read and cross-checked with it."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelFileError(f"{index}: not a safetensors index ({type(exc).__name__}: {exc})") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelFileError(f"{index}: its weight_map is empty or not an object")
    entries: dict[str, Entry] = {}
    meta: dict[str, str] = {}
    files = tuple(directory / str(name) for name in sorted(set(weight_map.values())))
    for shard in files:
        if not shard.is_file():
            raise ModelFileError(f"{shard}: the shard is missing ({index.name} maps tensors to it)")
        found, shard_meta = header(shard)
        meta = meta or shard_meta
        for name, entry in found.items():
            if name in entries:
                raise ModelFileError(f"{shard}: tensor {name!r} is in two shards")
            entries[name] = entry
    for name, shard_name in weight_map.items():
        if name not in entries or entries[name].file.name != Path(str(shard_name)).name:
            raise ModelFileError(f"{directory / str(shard_name)}: lacks tensor {name!r}, which {index.name} maps to it")
    return Safetensors(directory, files, entries, meta)


def header(path: Path) -> tuple[dict[str, Entry], dict[str, str]]:
    """A safetensors file's tensors and metadata, checked against its size; ModelFileError."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            head = fh.read(8)
            length = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 2 <= length <= min(MAX_HEADER, size - 8):
                raise ModelFileError(f"{path}: not a safetensors file (no valid header length at its start)")
            raw = json.loads(fh.read(length))
    except FileNotFoundError:
        raise ModelFileError(f"{path}: no such file") from None
    except (UnicodeDecodeError, ValueError) as exc:
        if isinstance(exc, ModelFileError):
            raise
        raise ModelFileError(f"{path}: not a safetensors file (its header is not JSON)") from None
    except OSError as exc:
        raise ModelFileError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    if not isinstance(raw, dict):
        raise ModelFileError(f"{path}: not a safetensors file (its header is not a JSON object)")
    meta = raw.pop("__metadata__", None) or {}
    entries = {name: _entry(path, name, info, 8 + length, size) for name, info in raw.items()}
    if not entries:
        raise ModelFileError(f"{path}: holds no tensors")
    return entries, {str(k): str(v) for k, v in meta.items()} if isinstance(meta, dict) else {}


def _entry(path: Path, name: str, info: Any, base: int, size: int) -> Entry:
    """One header record as an Entry, its byte range checked against its dtype, shape and the file."""
    try:
        dtype, shape, (start, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
        start, end = int(start), int(end)
    except (KeyError, TypeError, ValueError):
        raise ModelFileError(
            f"{path}: not a safetensors file (tensor {name!r} has a malformed header record)"
        ) from None
    if dtype not in DTYPES:
        raise ModelFileError(f"{path}: tensor {name!r} has dtype {dtype}, which dldctl cannot load")
    numel = 1
    for d in shape:
        numel *= d
    if not 0 <= start <= end <= size - base or end - start != numel * DTYPES[dtype][1] or min(shape, default=0) < 0:
        raise ModelFileError(f"{path}: tensor {name!r} {list(shape)} {dtype}: its bytes do not fit the file (cut off?)")
    return Entry(dtype, shape, path, base + start, base + end)


def write_single(src: Safetensors, out: BinaryIO) -> None:
    """`src` as one safetensors file into `out`: a single file copied as is, shards merged (a new
    header, then each tensor's bytes streamed from its shard). No torch."""
    if len(src.files) == 1:
        with open(src.files[0], "rb") as fh:
            shutil.copyfileobj(fh, out, 1 << 20)
        return
    # widest elements first keeps every tensor aligned to its element size (as safetensors does)
    order = sorted(src.entries, key=lambda n: (-DTYPES[src.entries[n].dtype][1], n))
    head: dict[str, Any] = {"__metadata__": dict(src.metadata)} if src.metadata else {}
    offset = 0
    for name in order:
        e = src.entries[name]
        head[name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [offset, offset + e.end - e.start]}
        offset += e.end - e.start
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-aligned
    out.write(struct.pack("<Q", len(text)) + text)
    for name in order:
        e = src.entries[name]
        with open(e.file, "rb") as fh:
            fh.seek(e.start)
            left = e.end - e.start
            while left:
                chunk = fh.read(min(left, 1 << 20))
                if not chunk:
                    raise ModelFileError(f"{e.file}: ends inside tensor {name!r}")
                out.write(chunk)
                left -= len(chunk)


def read_safetensors(src: Safetensors) -> ModelFile:
    """The tensors of a scanned source as CPU torch tensors, by torch alone (each file mapped
    copy-on-write: torch.frombuffer wants a writable buffer; nothing is written back)."""
    import torch

    tensors: dict[str, Any] = {}
    maps: dict[Path, mmap.mmap] = {}
    try:
        for name, e in src.entries.items():
            dtype = getattr(torch, DTYPES[e.dtype][0])
            if e.end == e.start:
                tensors[name] = torch.empty(e.shape, dtype=dtype)
                continue
            if e.file not in maps:
                with open(e.file, "rb") as fh:
                    maps[e.file] = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
            flat = torch.frombuffer(
                maps[e.file], dtype=dtype, count=(e.end - e.start) // DTYPES[e.dtype][1], offset=e.start
            )
            tensors[name] = flat.reshape(e.shape)
    except OSError as exc:
        raise ModelFileError(f"{src.source}: cannot read it ({exc.strerror or exc})") from None
    run, step = src.metadata.get("run"), src.metadata.get("outer_step")
    exported = run is not None and step is not None and step.isdigit()  # dldctl export's metadata
    return ModelFile(
        tensors,
        exported=exported,
        run_id=run if exported else None,
        outer_steps=int(step) if exported and step is not None else None,
        format="safetensors",
    )
