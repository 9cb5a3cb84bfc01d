#!/usr/bin/env bash
# One device call on `nvidia-h200` for LoRA on the megatron backend (issue 17A): the LoRA tests, then the
# full fine-tuning tests of the same backend (its LoRA changes touch their forward and export). Carry .whl
# holding megatron-core 0.16.1 (cp312), transformers 5.24.0, pytest 9.2.0 and pytest-asyncio 1.5.0.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false CUDA_VISIBLE_DEVICES=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
for suite in test_megatron_lora test_megatron; do
  start=$(date +%s)
  timeout "${SUITE_TIMEOUT:-140}" python3 -m pytest "tests/gpu/$suite.py" -q -rfE -p no:cacheprovider --timeout 60 \
    -W ignore --durations=8 >"$OUT/$suite.log" 2>&1
  echo "$suite rc=$? in $(( $(date +%s) - start )) s"
  grep -E "passed|failed|Error|assert|^[0-9.]+s (call|setup)" "$OUT/$suite.log" | tail -25
done
