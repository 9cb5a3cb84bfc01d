"""`python -m miles.driver.local_server --model-path DIR ...`: the gateway over the local runtime.

One process holds the gateway, the trainer and a CPU engine subprocess: system tests, benchmarks and
experiments on one machine. Jobs (`miles.driver.serve`, tiny-cpu included) build the gateway over the Ray
runtime.
The gateway package itself has no entry point: it serves whatever runtime its caller composes.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from miles.checkpoints.manager import CheckpointManager
from miles.gateway.app import create_app
from miles.gateway.auth import ApiKeys
from miles.gateway.server import run_event_loop, serve_gateway
from miles.gateway.settings import GatewaySettings
from miles.runtime.local import LocalRuntime
from miles.runtime.metered import MeteredRuntime
from miles.state import open_state_store
from miles.train.coalescer import DEFAULT_WINDOW_S


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m miles.driver.local_server", description=__doc__)
    p.add_argument(
        "--model-path", required=True, type=Path, help="HF model directory (config, tokenizer, weights)"
    )
    p.add_argument(
        "--model-name", default=None, help="name clients send as base_model (default: directory name)"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--api-keys-file", type=Path, default=None, help="file of 'KEY [TENANT]' lines")
    p.add_argument("--api-keys-env", default="MILES_API_KEYS", help="env var with comma-separated keys")
    p.add_argument("--checkpoint-root", type=Path, required=True)
    p.add_argument("--state-url", default=None, help="memory:// (default) or redis://HOST:PORT/DB")
    p.add_argument(
        "--state-key-prefix", default="miles", help="Redis key prefix (one per gateway deployment)"
    )
    p.add_argument("--long-poll-s", type=float, default=25.0)
    p.add_argument("--fwdbwd-max-chunk-len", type=int, default=None)
    p.add_argument(
        "--proto-compress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask clients to zstd forward_backward bodies (default on; plain bodies are accepted either way)",
    )
    p.add_argument(
        "--lora-batch-window-ms",
        type=float,
        default=DEFAULT_WINDOW_S * 1000,
        help="how long a LoRA model's forward_backward waits for those of other recently active models, to "
        "run them as one pass (the preset's runtime.lora_batch_window_ms; 0 = never wait)",
    )
    p.add_argument("--engine-log", type=Path, default=None)
    p.add_argument("--request-log", type=Path, default=None, help="JSONL log of every request")
    p.add_argument(
        "--tokenizer-id", default=None, help="what get_info reports (default: the model directory)"
    )
    return p


def _keys(args: argparse.Namespace) -> ApiKeys:
    if args.api_keys_file is not None:
        return ApiKeys.from_file(args.api_keys_file)
    if os.environ.get(args.api_keys_env):
        return ApiKeys.from_env(args.api_keys_env)
    raise SystemExit(f"no API keys: pass --api-keys-file or set ${args.api_keys_env}")


async def _main(args: argparse.Namespace) -> None:
    model_path = args.model_path.resolve()
    if args.lora_batch_window_ms < 0:
        raise SystemExit(f"--lora-batch-window-ms {args.lora_batch_window_ms:g}: give 0 (never wait) or more")
    if not (model_path / "config.json").is_file():
        raise SystemExit(f"--model-path {model_path} has no config.json; give a Hugging Face model directory")
    auth = _keys(args)
    settings = GatewaySettings(
        long_poll_s=args.long_poll_s,
        fwdbwd_max_chunk_len=args.fwdbwd_max_chunk_len,
        proto_compress_fwdbwd=args.proto_compress,
        request_log_path=str(args.request_log) if args.request_log else None,
    )
    store = open_state_store(args.state_url, key_prefix=args.state_key_prefix)
    checkpoints = CheckpointManager(args.checkpoint_root, store)
    runtime = await LocalRuntime.start(
        model_path,
        model_name=args.model_name or model_path.name,
        engine_log=args.engine_log,
        tokenizer_id=args.tokenizer_id,
        lora_batch_window_s=args.lora_batch_window_ms / 1000,
    )
    try:
        app = create_app(MeteredRuntime(runtime), store, checkpoints, auth, settings, owns_runtime=True)
        await serve_gateway(app, args.host, args.port)
    finally:
        await runtime.close()
        await store.close()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_event_loop(_main(_parser().parse_args()))


if __name__ == "__main__":
    main()
