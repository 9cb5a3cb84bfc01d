#!/usr/bin/env bash
# Builds .kit/: what the whole job (launcher, Ray, driver, gateway, CPU engine, trainer) and the tinker SDK
# need on the GPU device machine and its image lacks, for tests/gpu/run_rl_loop.sh (bench/rl_loop.py).
#
#   scripts/device_kit.sh            # then: run with carry [".kit"]; the command: bash tests/gpu/run_rl_loop.sh
#
# The device image ('cuda': Python 3.12, no network; its package list is in the device tool's KINDS.md) has
# torch 2.11 + CUDA, transformers 5.17, peft, numpy, httpx 0.28, aiohttp, anyio, attrs, annotated-doc,
# click, grpcio (ray[client]: the job starts Ray's client server), h11, msgpack, protobuf, psutil, PyYAML,
# requests, rich, safetensors, tokenizers, prometheus-client, uvloop, nvidia-ml-py, typing-extensions...
# but no Ray, FastAPI/Starlette/uvicorn, pydantic, tinker. .kit/ holds, under the device tool's 64 MiB per
# call (the working tree, ~4 MiB, travels too: the kit must stay under ~60 MiB):
#   ray.tar.xz   ray 2.60.0 (cp312 manylinux wheel) unpacked, without serve, rllib, tune, train, data, llm,
#                air, the Java jars and the dashboard's web UI, its three binaries stripped; untar into a
#                site directory
#   whl/         cp312 manylinux / pure wheels at the dev venv's versions (`.venv/bin/pip freeze`), except
#                transformers 5.24.0 (what tests/gpu carries: the image's 5.17 lacks the cache API the CPU
#                engine uses; the venv's newer one wants a newer huggingface_hub than the image has)
#   MANIFEST     the list, the sizes, the total
# The list: pyproject's runtime extra and what `pip show` says tinker 0.38, ray 2.60, fastapi, uvicorn and
# pydantic require, less what the image has. typing_extensions is there too (pydantic 2.14 wants >= 4.16):
# run_rl_loop.sh installs a wheel only where the image has no such package or an older one. Downloads are
# cached in KIT_CACHE (default /tmp/miles-kit-cache).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
kit=$root/.kit
cache=${KIT_CACHE:-/tmp/miles-kit-cache}
limit_mib=${KIT_LIMIT_MIB:-60}
python=$root/.venv/bin/python

# the runtime extra's and the SDK's packages the image lacks (and their own requirements)
packages=(
  fastapi starlette uvicorn httptools                              # the gateway and the CPU engine's server
  pydantic pydantic_core annotated-types typing-inspection opentelemetry-api
  tinker pyqwest distro orjson zstandard h2 hpack hyperframe        # the SDK (httpx[http2]) and its codec
  jsonschema jsonschema-specifications referencing rpds-py          # ray's requirements the image lacks
  redis                                                             # miles.state (a redis state backend)
  sniffio                                                           # tinker's
  typing_extensions                                                 # newer than the image may have
  pytest-asyncio                                                    # the GPU tests' async engine tests
)
pinned=(transformers==5.24.0)
ray_spec=ray==2.60.0
ray_prune=(serve rllib tune train data llm air jars dashboard/client/build)

freeze=$("$python" -m pip freeze)
specs=()
for name in "${packages[@]}"; do
  pattern="^${name//[-_]/[-_]}=="
  spec=$(grep -i "$pattern" <<<"$freeze") || { echo "not in the dev venv: $name" >&2; exit 1; }
  specs+=("$spec")
done
specs+=("${pinned[@]}")

platforms=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for n in 17 24 27 28 31 34 35 39; do  # as bench/device_bundle.sh, whose wheels ran there
  platforms+=(--platform "manylinux_2_${n}_x86_64")
done
download() {  # (pip's notes about this machine's unreachable extra index dropped)
  "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d "$cache" "$@" 2> >(grep -v "^WARNING: Location 'file:" >&2)
}
mkdir -p "$cache"
download "${specs[@]}" "$ray_spec"

wheel_of() {  # NAME==VERSION -> its wheel in the cache
  local name=${1%%==*} version=${1#*==}
  local stem
  stem=$(tr '[:upper:]-' '[:lower:]_' <<<"$name")
  find "$cache" -maxdepth 1 -iname "${stem}-${version}-*.whl" | sort | head -1
}

rm -rf "$kit"
mkdir -p "$kit/whl"
for spec in "${specs[@]}"; do
  wheel=$(wheel_of "$spec")
  [[ -n $wheel ]] || { echo "no cp312 wheel for $spec in $cache" >&2; exit 1; }
  cp "$wheel" "$kit/whl/"
done

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
unzip -q "$(wheel_of "$ray_spec")" -d "$stage/site"
for dir in "${ray_prune[@]}"; do
  rm -rf "${stage:?}/site/ray/$dir"
done
strip --strip-unneeded "$stage/site/ray/_raylet.so" "$stage/site/ray/core/src/ray/gcs/gcs_server" \
  "$stage/site/ray/core/src/ray/raylet/raylet"
find "$stage/site" -name __pycache__ -prune -exec rm -rf {} +
tar -C "$stage/site" -cf - . | xz -T2 -6 >"$kit/ray.tar.xz"

{
  echo "# .kit built $(date -u '+%F %T') UTC by scripts/device_kit.sh"
  echo "ray.tar.xz  $ray_spec pruned (${ray_prune[*]}), binaries stripped"
  (cd "$kit" && du -b ray.tar.xz whl/*.whl)
} >"$kit/MANIFEST"
total=$(du -cb "$kit"/ray.tar.xz "$kit"/whl/*.whl | tail -1 | cut -f1)
total_mib=$(awk -v b="$total" 'BEGIN { printf "%.1f", b / 1048576 }')
echo "total ${total_mib} MiB" >>"$kit/MANIFEST"
(cd "$kit" && ls -l ray.tar.xz whl | sed 's/^/  /')
echo ".kit: ${#specs[@]} wheels + ray.tar.xz = ${total_mib} MiB (limit ${limit_mib} MiB)"
if ((total > limit_mib * 1048576)); then
  echo "the kit is over ${limit_mib} MiB: it will not travel with a device call" >&2
  exit 1
fi
