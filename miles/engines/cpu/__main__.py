"""`python -m miles.engines.cpu --model-path DIR --port P [--host H] [--legacy-weight-api] [--api-key K]`."""

from __future__ import annotations

import logging
import os

from miles.contract.engine_args import cpu_engine_parser

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


def main(argv: list[str] | None = None) -> None:
    # imported here, not at the top: importing the package must stay light (no torch at import)
    import torch
    import uvicorn

    from miles.engines.cpu.graphs import DecodeOptions
    from miles.engines.cpu.server import create_app

    parser = cpu_engine_parser()
    args = parser.parse_args(argv)
    if not os.path.isdir(args.model_path):
        parser.error(f"--model-path {args.model_path!r} is not a directory")
    try:
        decode = DecodeOptions(
            cache=args.decode_cache,
            graphs=not (args.disable_decode_cuda_graph or args.disable_cuda_graph),
            graph_max_bs=args.cuda_graph_max_bs_decode,
        )
    except ValueError as exc:
        parser.error(str(exc))
    torch.set_num_threads(max(args.threads, 1))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(
        args.model_path,
        api_key=args.api_key,
        legacy_weight_api=args.legacy_weight_api,
        served_model_name=args.served_model_name,
        max_running_requests=args.max_running_requests,
        enable_memory_saver=args.enable_memory_saver,
        enable_weights_cpu_backup=args.enable_weights_cpu_backup,
        dtype=args.dtype,
        decode=decode,
    )
    uvicorn.run(
        app, host=args.host, port=args.port, timeout_keep_alive=keepalive_from_env(), log_level="warning"
    )  # type: ignore[arg-type]


if __name__ == "__main__":
    main()
