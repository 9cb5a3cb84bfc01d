"""The environment every engine process (SGLang or the CPU engine) is started with."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

from miles.utils.http import KEEPALIVE_EXPIRY_S

log = logging.getLogger(__name__)

KEEPALIVE_ENV = "SGLANG_TIMEOUT_KEEP_ALIVE"

# Defaults applied only where the driver's environment does not set the variable (the operator wins).
ENGINE_ENV_DEFAULTS: dict[str, str] = {
    # SGLang's uvicorn closes idle connections after 5 s by default; a push that pauses longer than that
    # between two buckets would race the close. 600 s keeps the server side well clear of any pause, and
    # our client expires idle connections after 2 s anyway (miles.utils.http), so both sides agree.
    KEEPALIVE_ENV: "600",
    # Engines are long-running services whose logs are read live (job logs, watchdog).
    "PYTHONUNBUFFERED": "1",
    # HF tokenizers' thread pool + fork in the engine's worker processes deadlocks or warns.
    "TOKENIZERS_PARALLELISM": "false",
    # The weight-update group is joined by the trainer too; SGLang runs NCCL with cuMem disabled, and both
    # sides of one NCCL communicator must agree on it.
    "NCCL_CUMEM_ENABLE": "0",
}


def engine_env(
    base: Mapping[str, str] | None = None, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """`base` (default: os.environ) + `ENGINE_ENV_DEFAULTS` where `base` is silent + `extra` (per engine).

    `extra` is the engine's own explicit settings (e.g. CUDA_VISIBLE_DEVICES), so it overrides both.
    """
    env = dict(os.environ if base is None else base)
    for key, value in ENGINE_ENV_DEFAULTS.items():
        env.setdefault(key, value)
    env.update(extra or {})
    _check_keepalive(env[KEEPALIVE_ENV])
    return env


def _check_keepalive(raw: str) -> None:
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{KEEPALIVE_ENV}={raw!r} is not a number of seconds (e.g. 600)") from None
    if seconds <= KEEPALIVE_EXPIRY_S:
        log.warning(
            "%s=%s is not above the client's keep-alive expiry (%.1f s): idle pooled connections may meet "
            "resets; raise it (600 is the default)",
            KEEPALIVE_ENV,
            raw,
            KEEPALIVE_EXPIRY_S,
        )
