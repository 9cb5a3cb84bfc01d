#!/usr/bin/env bash
# One device call on `nvidia-h200-x2` for the megatron backend (issue 17): TP=1 on GPU 0, then TP=2 / DP=2 /
# PP=2 (full and LoRA) on both GPUs. Carry .whl holding megatron-core 0.16.1 (cp312), transformers 5.24.0,
# pytest 9.2.0 and pytest-asyncio 1.5.0 (the image has none of megatron-core, and transformers 5.17).
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, transformers, megatron.core as m; print("torch", torch.__version__, "transformers", transformers.__version__, "megatron-core", m.__version__, "gpus", torch.cuda.device_count())' 2>&1 | grep -v -i warn
start=$(date +%s)
CUDA_VISIBLE_DEVICES=0 timeout "${TP1_TIMEOUT:-150}" python3 -m pytest tests/gpu/test_megatron.py -q -rfE -p no:cacheprovider --timeout 50 -W ignore >"$OUT/megatron_tp1.log" 2>&1
echo "tp1 rc=$? in $(( $(date +%s) - start )) s"; grep -E "passed|failed|Error|assert" "$OUT/megatron_tp1.log" | tail -25
start=$(date +%s)
timeout "${TP2_TIMEOUT:-200}" python3 -m pytest tests/gpu/test_megatron_tp2.py -q -rfE -p no:cacheprovider --timeout 110 -W ignore >"$OUT/megatron_tp2.log" 2>&1
echo "tp2 rc=$? in $(( $(date +%s) - start )) s"; grep -E "passed|failed|Error|assert" "$OUT/megatron_tp2.log" | tail -25
