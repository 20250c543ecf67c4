#!/usr/bin/env bash
# The GPU checks in one go, on a host where `python3` has torch with CUDA and dldctl installed
# (`pip install --no-deps .` next to a CUDA torch): about 8 minutes on one H200 + 16 cores.
#
#   1. the CUDA path of the learner: tests/integration/test_cuda_learner.py (skipped without a GPU);
#   2. bench/learner_throughput.py on cuda: a real learner process vs the best plain loop for the
#      same recipe, gpt2-124m at 16 x 1024 in bf16 + torch.compile first (the headline), then
#      gpt-medium bf16 + compile, then gpt2-124m fp32 eager for reference; one repeat each;
#   3. bench/quality.py, a sweep with one CPU core per learner (the 2-core VM shares 2 cores among
#      4 learners and the syncer): does the Decoupled fleet's asynchrony cost shrink when the
#      learners do not wait for each other's CPU time?
#   4. (not in the default STAGES: ~6 min alone) the sharded syncer with cores to spare (issue 20):
#      bench/shard_scaling.py --quick (1 against 2 shards, the load generator on other cores) and
#      bench/shard_transfer.py --quick with CURVE (a joiner fetching from 1, 2, 4 shards). On the
#      2-core VM both are core-bound (BENCHMARKS.md, "Sharded syncer"); here each shard, the
#      generator and the joiner's link threads get their own cores.
# then a compact summary of what the stages wrote.
#
#   bench/gpu_check.sh OUT_DIR            (each stage writes its log and JSON there)
#   QUICK=1 bench/gpu_check.sh OUT_DIR    (short stages; cpu where cuda is absent: a dry run)
#   STAGES="1 2" T1=90 T2=120 bench/gpu_check.sh OUT_DIR   (only those stages, with those limits in s)
#   STAGES=4 TOTAL=420 bench/gpu_check.sh OUT_DIR           (the sharded syncer alone)
#   TOTAL=480 bench/gpu_check.sh OUT_DIR  (the whole script's budget, default 510 s: a stage gets
#                                          the lesser of its limit and what is left; stage 3 is
#                                          skipped when under 150 s are left)
#   PYTHON=/path/to/python bench/gpu_check.sh OUT_DIR   (default: python3 if it has torch, else .venv)
# Stage 2 stops starting runs 30 s before its limit (--budget-s) and tears its fleets down; a stage
# past its limit is stopped with SIGABRT, so Python's faulthandler prints where it was.
set -u -o pipefail
out=${1:?usage: bench/gpu_check.sh OUT_DIR}
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.." || exit 2
if [[ -z ${PYTHON:-} ]]; then
    PYTHON=python3
    python3 -c "import torch" 2>/dev/null || { [[ -x .venv/bin/python ]] && PYTHON=.venv/bin/python; }
fi
py="$PYTHON -X faulthandler"
stages=" ${STAGES:-1 2 3} "
total=${TOTAL:-510}
t0=$(date +%s)
stage() { echo "== $(($(date +%s) - t0)) s: $*"; }
# the lesser of $1 and what is left of the total (10 s kept for the summary)
limit() {
    local left=$((total - ($(date +%s) - t0) - 10))
    echo $(($1 < left ? $1 : left))
}

stage "machine"
nvidia-smi -L 2>&1 | head -4
nvidia-smi --query-gpu=name,compute_mode,memory.used --format=csv 2>&1 | head -3
nproc
$py -c "import torch, sys; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-')"

if [[ $stages == *" 1 "* ]]; then
    stage "1. CUDA learner test"
    timeout -k 20 -s ABRT "$(limit "${T1:-120}")" $py -m pytest -q -p no:cacheprovider -rs \
        tests/integration/test_cuda_learner.py 2>&1 | tee "$out/gpu_pytest.log" | tail -40
fi

if [[ $stages == *" 2 "* ]]; then
    t2=$(limit "${T2:-300}")
    stage "2. learner throughput (limit $t2 s)"
    devices=cuda
    $py -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || devices=cpu
    quick=${QUICK:+--quick}
    timeout -k 20 -s ABRT "$t2" $py bench/learner_throughput.py --devices "$devices" --repeats 1 $quick \
        --budget-s $((t2 > 60 ? t2 - 30 : t2 / 2)) --out "$out/learner_throughput_gpu.json" 2>&1 |
        tee "$out/learner_throughput.log" | tail -40
fi

if [[ $stages == *" 3 "* ]]; then
    t3=$(limit "${T3:-240}")
    if ((t3 < 150)); then
        stage "3. quality, one core per learner: skipped, only $t3 s left of TOTAL=$total"
    else
        stage "3. quality, one core per learner (limit $t3 s)"
        steps=${QUICK:+--steps 200}
        timeout -k 20 -s ABRT "$t3" $py bench/quality.py --extra-only --repeats 1 $steps \
            --out "$out/quality_cores.json" --extra quorum=4,overlap=false --extra quorum=1 \
            --extra rebase=true,quorum=2,max_lag=2 --extra quorum=4,rebase=true,max_lag=2 2>&1 |
            tee "$out/quality_cores.log" | tail -14
    fi
fi

if [[ $stages == *" 4 "* ]]; then
    t4=$(limit "${T4:-400}")
    stage "4. sharded syncer with cores to spare (limit $t4 s)"
    timeout -k 20 -s ABRT "$((t4 * 2 / 3))" $py bench/shard_scaling.py --quick \
        --out "$out/shard_scaling_cores.json" 2>&1 | tee "$out/shard_scaling.log" | tail -12
    timeout -k 20 -s ABRT "$(limit $((t4 / 3)))" $py bench/shard_transfer.py --quick \
        --out "$out/shard_transfer_cores.json" 2>&1 | tee "$out/shard_transfer.log" | tail -12
fi

stage "summary"
$PYTHON - "$out" "$stages" <<'EOF'
"""One line per result the stages left in OUT_DIR (missing files are said, not fatal)."""
import json
import sys
from pathlib import Path

out, stages = Path(sys.argv[1]), sys.argv[2].split()


def load(name):
    try:
        return json.loads((out / name).read_text())
    except (OSError, ValueError):
        return None


def num(v, fmt):
    return "?" if v is None else format(v, fmt)


log = out / "gpu_pytest.log"
lines = [l for l in log.read_text(errors="replace").splitlines() if l.strip()] if log.exists() else []
print("1. CUDA learner test:", lines[-1] if lines else "(no log)" if "1" in stages else "(not run)")
lt = load("learner_throughput_gpu.json")
none = "(no results)" if "2" in stages else "(not run)"
print("2. learner throughput:", none if lt is None else f"{lt.get('gpu') or 'cpu'}, torch {lt.get('torch')}")
for r in (lt or {}).get("rows", []):
    if "error" in r:
        print(f"   {r['case']:<22} not measured: {r['error'][:100]}")
        continue
    mb = lambda b: num(b / 2**20 if b else None, ",.0f")
    print(
        f"   {r['case']:<22} {r['recipe']:<13} plain {num(r['plain_tok_s'], ',.0f')} tok/s, learner "
        f"{num(r['learner_tok_s'], ',.0f')} tok/s, ratio {num(r['ratio'], '.3f')}, blocked {num(r['blocked'], '.2%')}, "
        f"peak MB {mb(r['plain_peak_bytes'])}/{mb(r['learner_peak_bytes'])} ({num(r['memory_ratio'], '.2f')}x), "
        f"first step s {num(r['plain_first_step_s'], '.1f')}/{num(r['learner_first_step_s'], '.1f')}, "
        f"warmup s {num(r['plain_warmup_s'], '.1f')}/{num(r['learner_warmup_s'], '.1f')} [{r['basis']}]"
    )
    print(f"   {'':<22} {r['verdict'] or 'no targets'}")
q = load("quality_cores.json")
print("3. quality, one core per learner:", ("(no results)" if "3" in stages else "(not run)") if q is None else "")
for r in (q or {}).get("rows", []):
    print(f"   {str(r.get('strategy')):<48} eval loss {r.get('eval loss')}  vs DP {r.get('vs DP')}")
sc, st = load("shard_scaling_cores.json"), load("shard_transfer_cores.json")
none = "(no results)" if "4" in stages else "(not run)"
v = (sc or {}).get("verdict") or {}
print("4. sharded syncer: scaling", none if sc is None else f"2 / 1 shards {num(v.get('ratio'), '.2f')}x "
      f"(target {v.get('target')}), per loop core {num(v.get('per_loop_core_ratio'), '.2f')}, "
      f"merge alone {num(v.get('merge_alone_ratio'), '.2f')}")
v = (st or {}).get("verdict") or {}
print("   state transfer", none if st is None else f"worst shard {num(v.get('worst_shard_vs_tcp'), '.0%')} of raw TCP "
      f"(target 30%), best aggregate {num(v.get('best_aggregate_MBs'), ',.0f')} MB/s from {v.get('best_aggregate_shards')} shards")
EOF
stage "done"
