"""Engine command lines: a preset's `engines.server_args` as flags, the way SGLang's argparse reads them,
and the CPU engine's own parser (the launcher checks a CPU preset's flags against it at submit)."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from typing import Any


def server_arg_flags(server_args: Mapping[str, Any]) -> list[str]:
    """`{key: value}` as argv: True -> bare flag, None/False -> nothing, a list -> the flag then one element
    per item (nargs options such as --lora-target-modules), a mapping -> JSON (--json-model-override-args),
    anything else -> `--flag=value` (one element: a value like "-1" stays a value)."""
    argv: list[str] = []
    for key, value in server_args.items():
        flag = "--" + str(key).replace("_", "-")
        if value is True:
            argv.append(flag)
        elif isinstance(value, list | tuple):
            argv += [flag, *(str(item) for item in value)]
        elif isinstance(value, Mapping):
            argv.append(f"{flag}={json.dumps(value)}")
        elif value is not None and value is not False:  # not `in (None, False)`: 0 == False would drop 0
            argv.append(f"{flag}={value}")
    return argv


DEFAULT_MAX_RUNNING_REQUESTS = 256  # the CPU engine's sequences per model step
DEFAULT_GRAPH_MAX_BS = 256  # the CPU engine's largest decode batch replayed as a CUDA graph


# SGLang's --dtype choices; "half" and "float" are its aliases of float16 and float32
ENGINE_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")


def cpu_engine_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m miles.engines.cpu", description="the SGLang-compatible CPU engine"
    )
    parser.add_argument(
        "--model-path", required=True, help="Hugging Face model directory (config, tokenizer, safetensors)"
    )
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument(
        "--legacy-weight-api",
        action="store_true",
        help="no begin/end_weight_update session (SGLang < 0.5.22)",
    )
    parser.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on every non-health route"
    )
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=list(ENGINE_DTYPES),
        help="weights' dtype (SGLang's flag). auto: the model's on a GPU, float32 on CPU (bf16 matmuls are "
        "slow there); a delta push needs the engine to hold the dtype the trainer sends",
    )
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    parser.add_argument(
        "--max-running-requests",
        type=int,
        default=DEFAULT_MAX_RUNNING_REQUESTS,
        help="sequences decoded together in one model step (SGLang's flag); the rest wait. 1: one at a time",
    )
    parser.add_argument(
        "--enable-memory-saver",
        action="store_true",
        help="release_memory_occupation frees the weights' memory (SGLang's flag); without it release and "
        "resume only keep the bookkeeping",
    )
    parser.add_argument(
        "--enable-weights-cpu-backup",
        action="store_true",
        help="keep a CPU copy of the weights across release_memory_occupation (SGLang's flag); without it "
        "they are undefined after resume until a weight update loads them",
    )
    parser.add_argument(
        "--disable-decode-cuda-graph",
        action="store_true",
        help="decode eagerly, no CUDA graph (SGLang's flag); on CPU there are none",
    )
    parser.add_argument(
        "--disable-cuda-graph", action="store_true", help="SGLang's older name of --disable-decode-cuda-graph"
    )
    parser.add_argument(
        "--cuda-graph-max-bs-decode",
        type=int,
        default=DEFAULT_GRAPH_MAX_BS,
        help="batches of more slots decode eagerly (SGLang's flag)",
    )
    parser.add_argument(
        "--decode-cache",
        default="auto",
        choices=["auto", "slots", "dynamic"],
        help="this engine's own: the KV cache a decode step runs on. auto/slots: fixed slots (replayable as "
        "a CUDA graph) where the model allows; dynamic: a cache grown one column a step (no graphs)",
    )
    return parser
