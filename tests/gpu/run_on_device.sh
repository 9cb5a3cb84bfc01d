#!/usr/bin/env bash
# One device call: environment facts, the training-throughput bench, then the GPU tests.
# Run from the repo root on the GPU machine with OUT set; carry .whl holding the wheels pytest 9.2.0,
# pytest-asyncio 1.5.0 and transformers 5.24.0 (the image has 5.17, whose outputs lack `.cache`, which the
# CPU engine's runner reads).
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TINKER_TELEMETRY=0 TOKENIZERS_PARALLELISM=false
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv,noheader
python3 -c 'import torch, transformers, peft, pytest; print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__, "pytest", pytest.__version__)'
timeout "${BENCH_TIMEOUT:-300}" python3 bench/train_throughput.py --json ${BENCH_ARGS:-} >"$OUT/bench.json" 2>"$OUT/bench.err"
echo "bench rc=$?"; grep -v Warning "$OUT/bench.err" | grep -E "^#|Error|error" | tail -20
python3 -c 'import json, sys; sys.path.insert(0, "bench"); import train_throughput as b
d = json.load(open(sys.argv[1])); print(d["setup"]); print(b.table([b.Result(**r) for r in d["results"]]))' "$OUT/bench.json"
timeout "${FAST_TIMEOUT:-240}" python3 -m pytest tests/gpu/test_train_fast_paths.py tests/gpu/test_engine_cuda.py -q -rfE --timeout 220 >"$OUT/gpu_fast_engine.log" 2>&1
echo "fast paths + engine rc=$?"; tail -15 "$OUT/gpu_fast_engine.log"
timeout "${MATHS_TIMEOUT:-420}" python3 -m pytest tests/gpu/test_train_maths.py -q -rfE --timeout 400 --durations=5 >"$OUT/gpu_maths.log" 2>&1
echo "maths rc=$?"; tail -15 "$OUT/gpu_maths.log"
