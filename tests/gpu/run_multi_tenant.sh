#!/usr/bin/env bash
# One device call for issue 16 (one GPU): the multi-tenant LoRA bench on the Qwen3-0.6B shape (window 5 ms
# measured; its rows and any --profile tables also go to stderr as '#' lines, shown here), the
# multi-tenant GPU test (bf16), the Qwen3-4B rows of the training-throughput bench with a profiler summary,
# then the Qwen3-0.6B rows (regression). Run from the repo root with OUT set; WHL (default .whl) holds the
# wheels transformers 5.24.0, pytest 9.2.0 and pytest-asyncio 1.5.0 (see run_on_device.sh). *_TIMEOUT and
# *_ARGS tune each step.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES:-0}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
WHL=${WHL:-.whl}
if ls "$WHL"/transformers-*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHL"/transformers-*.whl "$WHL"/pytest-*.whl "$WHL"/pytest_asyncio-*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, transformers, peft; print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__)'
start=$(date +%s)
timeout "${MT_TIMEOUT:-150}" python3 bench/multi_tenant.py ${MT_ARGS:---window-ms 5} >"$OUT/multi_tenant.txt" 2>"$OUT/multi_tenant.err"
echo "multi_tenant rc=$? in $(( $(date +%s) - start )) s"; cat "$OUT/multi_tenant.txt"; grep -E "^#|Error|error" "$OUT/multi_tenant.err" | tail -45
start=$(date +%s)
timeout "${TEST_TIMEOUT:-100}" python3 -m pytest tests/gpu/test_multi_tenant_cuda.py -q -s -rfE >"$OUT/gpu_test.log" 2>&1
echo "gpu test rc=$? in $(( $(date +%s) - start )) s"; grep -E "gradient error|^E  " "$OUT/gpu_test.log" | head -20; tail -4 "$OUT/gpu_test.log"
start=$(date +%s)
timeout "${B4_TIMEOUT:-150}" python3 bench/train_throughput.py --shape qwen3-4b ${B4_ARGS:---modes full,lora --variants ours_compiled --steps 2 --warmup 1 --micro-tokens 8192 --profile} >"$OUT/b4.txt" 2>"$OUT/b4.err"
echo "4b rc=$? in $(( $(date +%s) - start )) s"; grep -E "^#|Error" "$OUT/b4.err" | tail -40; cat "$OUT/b4.txt"
start=$(date +%s)
timeout "${B06_TIMEOUT:-60}" python3 bench/train_throughput.py ${B06_ARGS:---modes full,lora --variants ours_compiled --steps 4 --warmup 2} >"$OUT/b06.txt" 2>"$OUT/b06.err"
echo "0.6b rc=$? in $(( $(date +%s) - start )) s"; grep -E "Error" "$OUT/b06.err" | tail -5; cat "$OUT/b06.txt"
