"""The best plain PyTorch training loop for a model and a recipe: bench/learner_throughput.py's baseline.

Same model and data as a learner (`workload.build_workload`, the run's seed, learner index 0),
same AdamW, learning-rate schedule, gradient clipping and batch, and the recipe's speed-ups, with
nothing else in the loop (no loss read per step, no pushes, no heartbeats):

    precision "bf16"   forward and loss under torch.autocast(device_type, dtype=torch.bfloat16)
    compile true       torch.compile(model) (default mode), compiled at the first step
    tf32 true (CUDA)   TF32 matmuls and convolutions, through the legacy flags
                       (torch.backends.cuda.matmul.allow_tf32 / torch.backends.cudnn.allow_tf32):
                       inductor reads those, and mixing them with the newer `fp32_precision`
                       API fails compilation (pytorch/pytorch#166387)
    CUDA               AdamW(fused=True); on the CPU AdamW's default (foreach)

It runs in a fresh process of its own (`run_apart`): the learner it is compared with starts as a
fresh process too, so the time to the first step, the compilation and the peak memory count
alike, and this benchmark's process never holds the GPU. Its warmup steps (`warmup_steps` in
the spec: learner/recipe.py's count, 3 compiled and 1 eager) each end in a device synchronize and
a timestamp, and nothing syncs after them until the loss is read at the end, so the steady part
can be cut at any warmup up to that (at the learner's own, should it report another):

    steady tokens/s (w warmup steps) = (tokens - tokens after step w) / (loop_s - marks_s[w - 1])

    python bench/plain_loop.py SPEC.json OUT.json     (what run_apart starts)
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class Recipe:
    """How a case trains: the `[run]` keys `precision` and `compile` (resolved: no "auto"), and tf32."""

    precision: str  # "bf16" | "fp32"
    compile: bool
    tf32: bool = True

    @property
    def label(self) -> str:
        """ "bf16+compile", "fp32", ..."""
        return self.precision + ("+compile" if self.compile else "")

    def run_keys(self) -> dict[str, Any]:
        """The learner's `[run]` keys for this recipe."""
        return {"precision": self.precision, "compile": self.compile, "tf32": self.tf32}


def default_warmup(compiled: bool) -> int:
    """Steps left out of the steady throughput, as learner/recipe.py counts them: the first (3 when
    compiled: the first forward and backward compile, and the next may recompile)."""
    return 3 if compiled else 1


def train(spec: dict[str, Any]) -> dict[str, Any]:
    """The loop itself, in this process; `spec`: run (the [run] table), device, threads, recipe,
    warmup_steps (the steps timed one by one), launched (time.time() when the process was started:
    the origin of `first_step_s`)."""
    import torch

    from bench.baseline_loop import InnerLoop, Strategy, inner_optimizer

    recipe, device = Recipe(**spec["recipe"]), torch.device(spec["device"])
    s, wl = _build(spec, device, recipe)
    fused = device.type == "cuda"
    model = cast(torch.nn.Module, torch.compile(wl.model)) if recipe.compile else wl.model
    opt = inner_optimizer(wl.model, s, fused)
    loop = InnerLoop(wl, opt, Strategy(model), s, device=device, precision=recipe.precision)
    out = _loop(loop, int(s["steps"]), int(spec["warmup_steps"]))
    out["first_step_s"] -= float(spec["launched"])
    return {
        **out,
        "peak_memory_bytes": peak_memory(device),
        "parameters": sum(p.numel() for p in wl.model.parameters()),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "precision": recipe.precision,
        "compiled": recipe.compile,
        "fused": fused,
        "tf32": recipe.tf32 and device.type == "cuda",
    }


def _loop(loop: Any, steps: int, warmup: int) -> dict[str, Any]:
    """`steps` inner steps and nothing else. The `warmup` first steps (at least one) end in a
    synchronize and a timestamp; the loss is read once, at the end."""
    tokens = 0
    marks: list[float] = []
    mark_tokens: list[int] = []
    first_step_at = 0.0
    _sync(loop.device)
    t0 = time.perf_counter()
    for step in range(steps):
        result = loop.step(loop.lr(step))
        tokens += result.tokens
        if step < max(1, warmup):
            _sync(loop.device)
            marks.append(time.perf_counter() - t0)
            mark_tokens.append(tokens)
        if step == 0:
            first_step_at = time.time()
    final = float(result.loss.detach())  # waits for the device
    loop_s = time.perf_counter() - t0
    return {
        "steps": steps,
        "tokens": tokens,
        "loop_s": loop_s,
        "marks_s": marks,
        "mark_tokens": mark_tokens,
        "first_step_s": first_step_at,  # a time.time(): train() makes it relative to the launch
        "final_loss": final,
    }


def _build(spec: dict[str, Any], device: Any, recipe: Recipe) -> tuple[dict[str, Any], Any]:
    """Threads, TF32, a clean peak-memory counter, then the workload (the model on the device)."""
    import torch

    from bench.baseline_loop import workload
    from syncer.common.settings import settings_from_dict

    torch.set_num_threads(int(spec["threads"]))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = recipe.tf32
        torch.backends.cudnn.allow_tf32 = recipe.tf32
        torch.cuda.reset_peak_memory_stats(device)
    s = settings_from_dict(dict(spec["run"])).to_dict()
    return s, workload(s, 0, 1, device, int(s["seed"]))


def _sync(device: Any) -> None:
    if device.type == "cuda":
        import torch

        torch.cuda.synchronize(device)


def peak_memory(device: Any) -> int:
    """Bytes: the device's peak allocation on CUDA, else this process's peak resident set (Linux
    reports ru_maxrss in KiB)."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def steady(result: dict[str, Any], warmup: int) -> dict[str, Any]:
    """The loop after its first `warmup` steps: tokens, seconds, tokens/s, and the warmup's seconds.
    `warmup` past the timed steps is cut at the last of them (and says so: `warmup_steps`)."""
    w = max(0, min(int(warmup), len(result["marks_s"])))
    warmup_s = result["marks_s"][w - 1] if w else 0.0
    tokens = result["tokens"] - (result["mark_tokens"][w - 1] if w else 0)
    seconds = result["loop_s"] - warmup_s
    return {
        "warmup_steps": w,
        "warmup_s": warmup_s,
        "steady_tokens": tokens,
        "steady_s": seconds,
        "tokens_per_s": tokens / seconds if seconds > 0 else 0.0,
    }


def run_apart(spec: dict[str, Any], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """`train(spec)` in a fresh `python bench/plain_loop.py` process (with `env` added to this
    one's environment); its result, or RuntimeError with the tail of its output."""
    with tempfile.TemporaryDirectory(prefix="plain-loop-") as tmp:
        spec_path, out_path, log_path = Path(tmp, "spec.json"), Path(tmp, "out.json"), Path(tmp, "log")
        argv = [sys.executable, "-X", "faulthandler", str(Path(__file__).resolve()), str(spec_path), str(out_path)]
        with open(log_path, "w") as log:
            spec_path.write_text(json.dumps({**spec, "launched": time.time()}))
            try:
                proc = subprocess.run(
                    argv,
                    cwd=ROOT,
                    env={**os.environ, **(env or {})},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    timeout=timeout,
                )
                failed = f"exit status {proc.returncode}" if proc.returncode else ""
            except subprocess.TimeoutExpired:
                failed = f"no result within {timeout:.0f} s (killed)"
        if failed or not out_path.exists():
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the plain loop failed ({failed or 'no output'}):\n{tail}")
        return dict(json.loads(out_path.read_text()))


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    Path(argv[1]).write_text(json.dumps(train(spec)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
