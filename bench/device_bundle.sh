#!/usr/bin/env bash
# Packs what bench/gateway.py and bench/gateway_floors.py import, and the device machine (Python 3.12, no
# network; torch, numpy, httpx, uvloop, aiohttp... already there) lacks, into one OUT_DIR/site.tar.xz under
# the device tool's 64 MiB carry limit (issue 24, the fourth pass: the benches on a 16-core host).
#
#   bench/device_bundle.sh OUT_DIR [WHEEL_DIR]
#
# cp312 manylinux wheels at the dev venv's versions (`.venv/bin/pip freeze`), unpacked as they are (a wheel
# is an installable zip); ray 2.60.0 without what the benches never import (serve, rllib, tune, train, data,
# llm, air, the Java jars, the dashboard's web UI), its binaries stripped; transformers with only the model
# families the tiny model, peft and the auto classes load. WHEEL_DIR (default /tmp/whl24) caches downloads.
# On the device: mkdir -p /tmp/site && tar -xJf OUT_DIR/site.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site
# and run the benches with HF_HUB_OFFLINE=1 and the GPU hidden: CUDA_VISIBLE_DEVICES= for the local runtime,
# CUDA_VISIBLE_DEVICES=-1,-1 RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1 for Ray
# (docs/gateway.md, "Method and re-running").
set -euo pipefail

out=$(realpath -m "${1:?usage: bench/device_bundle.sh OUT_DIR [WHEEL_DIR]}")
wheels=$(realpath -m "${2:-/tmp/whl24}")
root=$(cd "$(dirname "$0")/.." && pwd)
python=$root/.venv/bin/python

# ray[default]'s, tinker's, the gateway's and transformers 5.24's needs that the device lacks or has older
packages=(
  ray fastapi starlette uvicorn httptools pydantic pydantic_core annotated-types typing-inspection
  typing_extensions annotated-doc anyio sniffio tinker pyqwest distro orjson zstandard transformers
  huggingface_hub httpx2 httpcore2 h2 hpack hyperframe truststore peft jsonschema jsonschema-specifications
  referencing rpds-py protobuf grpcio msgpack click filelock opentelemetry-api opentelemetry-sdk
  opentelemetry-exporter-prometheus opentelemetry-proto opentelemetry-semantic-conventions aiohttp-cors
  colorful opencensus opencensus-context google-api-core google-auth googleapis-common-protos proto-plus
  pyasn1 pyasn1_modules smart_open wrapt
)
keep_models=(auto bloom encoder_decoder qwen2 qwen3 qwen3_moe llama)

freeze=$("$python" -m pip freeze)
specs=()
for name in "${packages[@]}"; do
  pattern="^${name//[-_]/[-_]}=="
  spec=$(grep -i "$pattern" <<<"$freeze") || { echo "not in the venv: $name" >&2; exit 1; }
  specs+=("$spec")
done

platforms=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for n in 17 24 27 28 31 34 35 39; do
  platforms+=(--platform "manylinux_2_${n}_x86_64")
done
mkdir -p "$wheels"
"$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d "$wheels" "${specs[@]}"

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
site=$stage/site
mkdir -p "$site"
for spec in "${specs[@]}"; do
  name=${spec%%==*}
  version=${spec#*==}
  pattern=$(tr '[:upper:]-' '[:lower:]_' <<<"$name")
  wheel=$(find "$wheels" -maxdepth 1 -iname "${pattern}-${version}-*.whl" | head -1)
  [[ -n $wheel ]] || { echo "no wheel for $spec in $wheels" >&2; exit 1; }
  unzip -q -o "$wheel" -d "$site"
done

rm -rf "$site"/ray/{serve,rllib,tune,train,data,llm,air,jars} "$site"/ray/dashboard/client/build
strip --strip-unneeded "$site"/ray/_raylet.so "$site"/ray/core/src/ray/gcs/gcs_server \
  "$site"/ray/core/src/ray/raylet/raylet
for model in "$site"/transformers/models/*/; do
  base=$(basename "$model")
  [[ " ${keep_models[*]} " == *" $base "* ]] || rm -rf "$model"
done
find "$site" -name __pycache__ -prune -exec rm -rf {} +

mkdir -p "$out"
tar -C "$site" -cf - . | xz -T1 -6 >"$out/site.tar.xz"
du -h "$out/site.tar.xz"
