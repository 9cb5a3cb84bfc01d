#!/usr/bin/env bash
# One device call for issue 17 B: the megatron weight push through the sender's commands into the CPU engine
# on CUDA (tests/gpu/test_megatron_push.py: TP 1 on GPU 0; TP 2 on GPUs 0-1 when two are visible), then
# bench/train_throughput.py --backend megatron on GPU 0 (plain loop, transformers backend, megatron backend;
# Qwen3-0.6B shape, bf16, 8 x 2048 tokens, full fine-tuning). Carry .whl: megatron-core 0.16.1 (cp312),
# transformers 5.24.0, pytest 9.2.0, pytest-asyncio 1.5.0 (the image has no megatron-core, and
# transformers 5.17). On two GPUs, only the push tests: SKIP_BENCH=1 bash tests/gpu/run_megatron_push_bench.sh
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false TINKER_TELEMETRY=0
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PY:-python3}
if ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
start=$(date +%s)
timeout "${PUSH_TIMEOUT:-100}" $PY -m pytest tests/gpu/test_megatron_push.py -q -rfEs -p no:cacheprovider \
  --timeout 90 -W ignore --durations=5 >"$OUT/megatron_push.log" 2>&1
echo "push rc=$? in $(( $(date +%s) - start )) s"; tail -12 "$OUT/megatron_push.log"
[ "${SKIP_BENCH:-0}" = 1 ] && exit 0  # the two-GPU run (issue 22 run 3) needs only the push tests
start=$(date +%s)
CUDA_VISIBLE_DEVICES=${BENCH_GPU:-0} timeout "${BENCH_TIMEOUT:-160}" $PY bench/train_throughput.py --backend megatron \
  --json --steps "${STEPS:-5}" --warmup "${WARMUP:-2}" ${BENCH_ARGS:-} >"$OUT/bench_megatron.json" 2>"$OUT/bench_megatron.err"
echo "bench rc=$? in $(( $(date +%s) - start )) s"; grep -E "^#|Error|error" "$OUT/bench_megatron.err" | tail -12
$PY -c 'import json, sys; sys.path.insert(0, "bench"); import train_throughput as b
d = json.load(open(sys.argv[1])); print(d["setup"]); print(b.table([b.Result(**r) for r in d["results"]]))' \
  "$OUT/bench_megatron.json"
