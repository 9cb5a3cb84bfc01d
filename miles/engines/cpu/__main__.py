"""`python -m miles.engines.cpu --model-path DIR --port P [--host H] [--legacy-weight-api] [--api-key K]`."""

from __future__ import annotations

import argparse
import logging
import os

KEEPALIVE_ENV = "SGLANG_TIMEOUT_KEEP_ALIVE"
SGLANG_DEFAULT_KEEPALIVE_S = 5  # what SGLang uses when the variable is unset


def keepalive_from_env(env: dict[str, str] | os._Environ[str] = os.environ) -> float:
    raw = env.get(KEEPALIVE_ENV)
    if raw is None or raw == "":
        return SGLANG_DEFAULT_KEEPALIVE_S
    try:
        return float(raw)
    except ValueError:
        raise SystemExit(f"{KEEPALIVE_ENV}={raw!r} is not a number of seconds") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m miles.engines.cpu", description=__doc__)
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
    parser.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "2")))
    return parser


def main(argv: list[str] | None = None) -> None:
    # imported here, not at the top: the launcher checks a preset's engine flags against build_parser on
    # login nodes, which have no torch (tests/fast/launcher/test_login_node_imports.py)
    import torch
    import uvicorn

    from miles.engines.cpu.server import create_app

    parser = build_parser()
    args = parser.parse_args(argv)
    if not os.path.isdir(args.model_path):
        parser.error(f"--model-path {args.model_path!r} is not a directory")
    torch.set_num_threads(max(args.threads, 1))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(
        args.model_path,
        api_key=args.api_key,
        legacy_weight_api=args.legacy_weight_api,
        served_model_name=args.served_model_name,
    )
    uvicorn.run(
        app, host=args.host, port=args.port, timeout_keep_alive=keepalive_from_env(), log_level="warning"
    )  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
