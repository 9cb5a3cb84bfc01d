#!/usr/bin/env bash
# One device call (one GPU): bench/rl_loop.py, an RL loop through the whole job (launcher submit --scheduler
# local, Ray, the driver, the gateway, the colocated trainer and engine) against the plain single-process
# loop on the same GPU. Run from the repo root with OUT set and `.kit` carried (scripts/device_kit.sh builds
# it on the development machine; the image lacks Ray, FastAPI, pydantic, tinker...):
#
#   device run, carry [".kit"]:  MILES_GIT_COMMIT=<sha> bash tests/gpu/run_rl_loop.sh
#
# GPU_TESTS (default the colocation ones; empty: none, TESTS_TIMEOUT 240 s) run first, then, when ENGINE_ARGS
# is set, bench/engine_batching.py --device cuda $ENGINE_ARGS (ENGINE_TIMEOUT 150 s), when DECODE_ARGS is set,
# bench/engine_decode.py --device cuda $DECODE_ARGS (DECODE_TIMEOUT 150 s), when IPC_ARGS is set,
# bench/ipc_push.py --device cuda $IPC_ARGS (IPC_TIMEOUT 150 s), then, when SELFTEST_ARGS
# is set, `launcher selftest $SELFTEST_ARGS --json` (SELFTEST_TIMEOUT 300 s; $OUT/selftest.json), then the
# bench unless RL_ARGS is "none".
# RL_ARGS (default "--timeout 300") go to bench/rl_loop.py (its default preset: qwen3-0.6b-shape-colocated,
# 8 groups x 8 samples x 128 tokens, 5 steps + 1 warm-up); RL_TIMEOUT (default 520 s) bounds it. Leaves
# $OUT/rl_loop.json (everything), rl_loop.txt (the tables), rl_loop.err (progress, bring-up, errors) and, if
# the bench fails, rl_loop_logs.tar.gz (the newest run directory's logs, preset and job script). RL2_ARGS
# (RL2_TIMEOUT, default 300 s) runs the bench again after it, into rl_loop_2.*: an A/B on one machine.
#
# Why a python of our own: the job script runs every step with the python that rendered it (`$PY -m ...`)
# and Ray as `$(dirname $PY)/ray`. The kit's Ray is unpacked, not installed, so no `ray` command exists
# beside the image's python3 (/opt/torch/.venv/bin/python3, a venv). So this builds $ENV_DIR: bin/python3 a
# link to that interpreter, bin/ray a script running Ray's CLI with it, and the venv's pyvenv.cfg and
# site-packages (links), so that python3 is the image's venv under another path. The bench runs with it and
# starts the launcher as `python -m launcher` with its own sys.executable, so the job renders PY and RAY_BIN
# there. The wheels go to $SITE (/tmp/site) and Ray is untarred there; PYTHONPATH=$SITE:$PWD.
set -u
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TINKER_TELEMETRY=0 TOKENIZERS_PARALLELISM=false
export RAY_USAGE_STATS_ENABLED=0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}
KIT=${KIT:-.kit}
SITE=${SITE:-/tmp/site}
ENV_DIR=${ENV_DIR:-/tmp/kitenv}
mkdir -p "$OUT" "$SITE"
t0=$(date +%s)
elapsed() { echo "$(($(date +%s) - t0)) s"; }

[[ -f $KIT/ray.tar.xz && -d $KIT/whl ]] || { echo "no $KIT/ray.tar.xz or $KIT/whl: run scripts/device_kit.sh here and carry .kit"; exit 2; }

# 1. the kit's wheels where the image has no such package or an older one, then Ray
python3 - "$KIT/whl" >/tmp/kit-wanted.txt <<'EOF'
import importlib.metadata as md
import pathlib
import sys

from packaging.utils import parse_wheel_filename
from packaging.version import Version

for wheel in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    name, version, _, _ = parse_wheel_filename(wheel.name)
    try:
        have = Version(md.version(name))
    except md.PackageNotFoundError:
        have = None
    if have is None or have < version:
        print(wheel)
    else:
        print(f"kit: the image has {name} {have} (kit {version}): kept", file=sys.stderr)
EOF
if [[ -s /tmp/kit-wanted.txt ]]; then
  xargs -a /tmp/kit-wanted.txt python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$SITE" || { echo "pip install of the kit's wheels failed"; exit 2; }
fi
tar -xJf "$KIT/ray.tar.xz" -C "$SITE" || { echo "untar of $KIT/ray.tar.xz failed"; exit 2; }
echo "kit: $(wc -l </tmp/kit-wanted.txt) wheels and ray into $SITE in $(elapsed)"

# 2. the image's python under $ENV_DIR, with `ray` beside it
python3 - "$ENV_DIR" <<'EOF' || { echo "building $ENV_DIR failed"; exit 2; }
import os
import pathlib
import shutil
import site
import sys

env = pathlib.Path(sys.argv[1])
shutil.rmtree(env, ignore_errors=True)
(env / "bin").mkdir(parents=True)
os.symlink(sys.executable, env / "bin" / "python3")
if sys.prefix != sys.base_prefix:  # a venv: its pyvenv.cfg and site-packages, so the link is that venv
    shutil.copy(pathlib.Path(sys.prefix) / "pyvenv.cfg", env / "pyvenv.cfg")
    for path in site.getsitepackages([sys.prefix]):
        if os.path.isdir(path):
            target = env / os.path.relpath(path, sys.prefix)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(path, target)
ray = env / "bin" / "ray"
ray.write_text(f"#!{env}/bin/python3\nimport sys\n\nfrom ray.scripts.scripts import main\n\nsys.exit(main())\n")
ray.chmod(0o755)
EOF
export PYTHONPATH=$SITE:$PWD
PY=$ENV_DIR/bin/python3
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
"$PY" -c 'import sys, torch, transformers, ray, tinker, fastapi, pydantic, grpc
print(sys.executable, sys.version.split()[0], "torch", torch.__version__, "transformers", transformers.__version__,
      "ray", ray.__version__, "tinker", tinker.__version__, "fastapi", fastapi.__version__, "pydantic",
      pydantic.__version__, "grpcio", grpc.__version__)' || { echo "the kit's python cannot import the stack"; exit 2; }
"$ENV_DIR/bin/ray" --version || { echo "$ENV_DIR/bin/ray does not run"; exit 2; }

# 3. the colocation GPU tests (release/resume, CUDA IPC, the trainer's offload) and the engine's batching
if [[ ${GPU_TESTS-tests/gpu/test_colocate_cuda.py tests/gpu/test_offload_cuda.py} ]]; then
  # shellcheck disable=SC2086  # GPU_TESTS is a list of files
  timeout "${TESTS_TIMEOUT:-240}" "$PY" -m pytest -q -n 0 -p no:cacheprovider \
    ${GPU_TESTS-tests/gpu/test_colocate_cuda.py tests/gpu/test_offload_cuda.py} >"$OUT/gpu_tests.txt" 2>&1
  echo "gpu tests rc=$? after $(elapsed)"
  tail -25 "$OUT/gpu_tests.txt"
fi
if [[ ${ENGINE_ARGS-} ]]; then
  # shellcheck disable=SC2086  # ENGINE_ARGS is a list of arguments
  timeout "${ENGINE_TIMEOUT:-150}" "$PY" bench/engine_batching.py --device cuda --json "$OUT/engine_batching.json" \
    $ENGINE_ARGS >"$OUT/engine_batching.txt" 2>&1
  echo "engine batching bench rc=$? after $(elapsed)"
  tail -15 "$OUT/engine_batching.txt"
fi

if [[ ${DECODE_ARGS-} ]]; then
  # shellcheck disable=SC2086  # DECODE_ARGS is a list of arguments
  timeout "${DECODE_TIMEOUT:-150}" "$PY" bench/engine_decode.py --device cuda --json "$OUT/engine_decode.json" \
    $DECODE_ARGS >"$OUT/engine_decode.txt" 2>&1
  echo "engine decode bench rc=$? after $(elapsed)"
  tail -20 "$OUT/engine_decode.txt"
fi

if [[ ${IPC_ARGS-} ]]; then
  # shellcheck disable=SC2086  # IPC_ARGS is a list of arguments
  timeout "${IPC_TIMEOUT:-150}" "$PY" bench/ipc_push.py --device cuda --json "$OUT/ipc_push.json" \
    $IPC_ARGS >"$OUT/ipc_push.txt" 2>&1
  echo "ipc push bench rc=$? after $(elapsed)"
  tail -8 "$OUT/ipc_push.txt"
fi

if [[ ${SELFTEST_ARGS-} ]]; then
  # shellcheck disable=SC2086  # SELFTEST_ARGS is a list of arguments
  timeout "${SELFTEST_TIMEOUT:-300}" "$PY" -m launcher selftest $SELFTEST_ARGS --json >"$OUT/selftest.json" \
    2>"$OUT/selftest.err"
  echo "selftest rc=$? after $(elapsed)"
  "$PY" - "$OUT/selftest.json" <<'EOF'
import json
import sys

try:
    result = json.load(open(sys.argv[1]))
except ValueError as exc:
    sys.exit(f"no selftest JSON: {exc}")
for row in result["rows"]:
    seconds = "" if row["seconds"] is None else f"{row['seconds']:8.2f}s"
    print(f"{row['step']:<11} {row['status']:<8} {seconds:>9}  {row['detail'][:400]}")
    if row["status"] == "fail":
        print(f"{'':<20} node {row['node']} log {row['log']} hint {row['hint']}")
print(result["message"])
EOF
fi

# 4. the bench, and a second run of it beside the first when RL2_ARGS is set (the same job with one
# setting changed, say: an A/B on one machine)
run_bench() {  # NAME ARGS TIMEOUT
  local name=$1 args=$2 limit=$3 rc run
  echo "bench: bench/rl_loop.py --json $OUT/$name.json $args (after $(elapsed))"
  # shellcheck disable=SC2086  # args is a list of arguments
  timeout "$limit" "$PY" bench/rl_loop.py --json "$OUT/$name.json" $args >"$OUT/$name.txt" 2>"$OUT/$name.err"
  rc=$?
  echo "bench rc=$rc after $(elapsed)"
  cat "$OUT/$name.txt"
  grep -vE "^\s*$|it/s\]|s/it\]" "$OUT/$name.err" | tail -60
  run=$(ls -dt runs/*/ 2>/dev/null | head -1)
  if [[ -n $run ]]; then  # a failed decode graph capture is only a warning (the engine decodes eagerly): show it
    grep -h -A25 "capturing the decode step failed" "$run"logs/*.log 2>/dev/null | head -60
  fi
  if ((rc != 0)) && [[ -n $run ]]; then
    echo "--- $run logs (tails) ---"
    for log in "$run"logs/*.log; do
      echo "== $log"
      tail -15 "$log"
    done
    tar -czf "$OUT/${name}_logs.tar.gz" -C "$run" logs preset.yaml job.sh 2>/dev/null
    ls -la "$OUT/${name}_logs.tar.gz"
  fi
  return "$rc"
}

[[ ${RL_ARGS-} == none ]] && exit 0
run_bench rl_loop "${RL_ARGS:---timeout 300}" "${RL_TIMEOUT:-520}"
rc=$?
if [[ ${RL2_ARGS-} ]]; then
  run_bench rl_loop_2 "$RL2_ARGS" "${RL2_TIMEOUT:-300}" || rc=$?
fi
exit "$rc"
