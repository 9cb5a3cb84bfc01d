#!/usr/bin/env bash
# `make demo`: the tiny-cpu preset on the local scheduler, a tinker-SDK client, then cancel.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TINKER_TELEMETRY=0 RAY_USAGE_STATS_ENABLED=0
exec .venv/bin/python -m miles.demo "$@"
