#!/usr/bin/env bash
# shellcheck disable=SC2086  # *_ARGS and TESTS are word lists on purpose
# One device call on `nvidia-h200-x2`: facts, the NCCL push bench, the data-parallel bench, the two-GPU tests.
# Run from the root of a committed snapshot of the repo with OUT set; WHL (default .whl) holds the wheels
# transformers 5.24.0 (the CPU engine needs it; the image has 5.17), pytest 9.2.0, pytest-asyncio 1.5.0.
# STEPS picks and orders the steps (default "push dp tests"); *_ARGS and *_TIMEOUT tune each.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# The lent multi-GPU machines forbid NVLink multicast (it can take the host's GPUs out of service).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
WHL=${WHL:-.whl}
if ls "$WHL"/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHL"/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
echo "commit $(cat COMMIT 2>/dev/null || git rev-parse HEAD 2>/dev/null)"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
nvidia-smi topo -m | head -4
python3 -c 'import torch, transformers; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version(), "gpus", torch.cuda.device_count(), "transformers", transformers.__version__)'
for step in ${STEPS:-push dp tests}; do
  start=$(date +%s)
  case $step in
    push)
      timeout "${PUSH_TIMEOUT:-170}" python3 bench/push_nccl.py --json ${PUSH_ARGS:-} >"$OUT/push.json" 2>"$OUT/push.err"
      echo "push rc=$? in $(( $(date +%s) - start )) s"; grep -E '^(\||device|check)|Error' "$OUT/push.err" | tail -30 ;;
    dp)
      timeout "${DP_TIMEOUT:-240}" python3 bench/train_dp.py --json ${DP_ARGS:-} >"$OUT/dp.json" 2>"$OUT/dp.err"
      echo "dp rc=$? in $(( $(date +%s) - start )) s"; grep -E '^(\||config|check|speed)|Error' "$OUT/dp.err" | tail -30 ;;
    tests)
      timeout "${TESTS_TIMEOUT:-170}" python3 -m pytest ${TESTS:-tests/gpu/test_push_nccl.py tests/gpu/test_dp_nccl.py} \
        -q -rfE --durations=8 >"$OUT/tests.log" 2>&1
      echo "tests rc=$? in $(( $(date +%s) - start )) s"; tail -25 "$OUT/tests.log" ;;
    elastic)  # issue 20/22: the core lane on GPU 0, an engine's GPU 1 borrowed as a hybrid lane
      timeout "${ELASTIC_TIMEOUT:-300}" python3 bench/elastic.py --engine --gpus \
        ${ELASTIC_ARGS:---hidden 1024 --layers 8 --batch 64 --seq-len 1024 --rounds 2 --steps 4} >"$OUT/elastic.txt" 2>"$OUT/elastic.err"
      echo "elastic rc=$? in $(( $(date +%s) - start )) s"; cat "$OUT/elastic.txt"; grep -E 'Error' "$OUT/elastic.err" | tail -10 ;;
    *) echo "unknown step $step" ;;
  esac
done
