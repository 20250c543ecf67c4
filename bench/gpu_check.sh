#!/usr/bin/env bash
# The GPU checks in one go, on a host where `python3` has torch with CUDA and dldctl installed
# (`pip install --no-deps .` next to a CUDA torch): about 8 minutes on one H200 + 16 cores.
#
#   1. the CUDA path of the learner: tests/integration/test_cuda_learner.py (skipped without a GPU);
#   2. bench/learner_throughput.py on cuda: a real learner process vs a plain PyTorch loop;
#   3. bench/quality.py, a sweep with one CPU core per learner (the 2-core VM shares 2 cores among
#      4 learners and the syncer): does the Decoupled fleet's asynchrony cost shrink when the
#      learners do not wait for each other's CPU time?
#
#   bench/gpu_check.sh OUT_DIR            (each stage writes its log and JSON there)
#   QUICK=1 bench/gpu_check.sh OUT_DIR    (short stages; cpu where cuda is absent: a dry run)
#   STAGES="1 2" T1=90 T2=120 bench/gpu_check.sh OUT_DIR   (only those stages, with those limits in s)
# A stage past its time limit is stopped with SIGABRT, so Python's faulthandler prints where it was.
set -u -o pipefail
out=${1:?usage: bench/gpu_check.sh OUT_DIR}
py="${PYTHON:-python3} -X faulthandler"
stages=" ${STAGES:-1 2 3} "
mkdir -p "$out"
t0=$(date +%s)
stage() { echo "== $(( $(date +%s) - t0 )) s: $*"; }

stage "machine"
nvidia-smi -L 2>&1 | head -4
nvidia-smi --query-gpu=name,compute_mode,memory.used --format=csv 2>&1 | head -3
nproc
$py -c "import torch, sys; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.cuda.is_available(),
      torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-')"

if [[ $stages == *" 1 "* ]]; then
stage "1. CUDA learner test"
timeout -s ABRT ${T1:-240} $py -m pytest -q -p no:cacheprovider -rs tests/integration/test_cuda_learner.py 2>&1 | tee "$out/gpu_pytest.log" | tail -40
fi

if [[ $stages == *" 2 "* ]]; then
stage "2. learner throughput"
devices=cuda
$py -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || devices=cpu
quick=${QUICK:+--quick}
timeout -s ABRT ${T2:-240} $py bench/learner_throughput.py --devices "$devices" $quick --out "$out/learner_throughput_gpu.json" 2>&1 |
    tee "$out/learner_throughput.log" | tail -40
fi

if [[ $stages == *" 3 "* ]]; then
stage "3. quality, one core per learner"
steps=${QUICK:+--steps 200}
timeout -s ABRT ${T3:-330} $py bench/quality.py --extra-only --repeats 1 $steps --out "$out/quality_cores.json" \
    --extra quorum=4,overlap=false --extra quorum=1 --extra rebase=true,quorum=2,max_lag=2 \
    --extra quorum=4,rebase=true,max_lag=2 2>&1 |
    tee "$out/quality_cores.log" | tail -14
fi
stage "done"
