"""`gateway:` and `watchdog:`: where the Tinker gateway listens and with which key, and when the job's
healthz watchdog ends it."""

from __future__ import annotations

import re
from typing import Any

from pydantic import Field, field_validator, model_validator

from miles.contract.preset.base import ENV_NAME, Port, PresetError, StrictModel

DEAD_PROBES_ENV = "GATEWAY_DEAD_PROBES"
# A dead-probe count beyond this is a typo, not a policy (10000 probes at 30 s is about 3.5 days)
MAX_DEAD_PROBES = 10_000
_PLAIN_COUNT = re.compile(r"0|[1-9][0-9]*")
# The gateway's request body limit without a preset too (miles.gateway.settings.DEFAULT_MAX_BODY_BYTES)
DEFAULT_MAX_BODY_MB = 128


def parse_dead_probes(value: str, name: str = DEAD_PROBES_ENV) -> int:
    """Parse a dead-probe count: a plain decimal integer 0..MAX_DEAD_PROBES, no sign, no leading zero."""
    if not isinstance(value, str) or not _PLAIN_COUNT.fullmatch(value):
        raise PresetError(
            f"{name}={value!r} is not a plain non-negative count: use digits only, without sign, "
            "spaces, decimals or leading zeros (e.g. 4; 0 disables the watchdog's exit)"
        )
    if len(value) > len(str(MAX_DEAD_PROBES)) or int(value) > MAX_DEAD_PROBES:
        raise PresetError(f"{name}={value!r} is too large: at most {MAX_DEAD_PROBES} (0 never exits)")
    return int(value)


class ApiKeySource(StrictModel):
    """Where the gateway's API key comes from: exactly one of a file or an environment variable."""

    file: str | None = Field(None, description="Path of a file holding the key.")
    env: str | None = Field(None, description="Name of an environment variable holding the key.")

    @model_validator(mode="after")
    def _exactly_one(self) -> ApiKeySource:
        if (self.file is None) == (self.env is None):
            raise ValueError("give exactly one of 'file' or 'env' (omit api_key to generate a key)")
        if self.env is not None and not ENV_NAME.fullmatch(self.env):
            raise ValueError(f"env: {self.env!r} is not a valid environment variable name")
        return self


class GatewayOptions(StrictModel):
    host: str = Field("0.0.0.0", description="Bind address; a specific address is also the probe address.")
    port: Port | None = Field(
        None, description="Gateway port on the head node; none = picked free when the job starts."
    )
    api_key: ApiKeySource | None = Field(
        None, description="`{file: PATH}` or `{env: NAME}`; none = generated."
    )
    tls_certfile: str | None = Field(
        None, description="PEM certificate (chain) to serve https; with tls_keyfile. None = plain http."
    )
    tls_keyfile: str | None = Field(None, description="PEM private key of tls_certfile (keep it mode 0600).")
    max_body_mb: int = Field(
        DEFAULT_MAX_BODY_MB,
        gt=0,
        description="Largest request body the gateway takes, in MiB (a zstd body counts decompressed); "
        "larger is a 413.",
    )
    otel_endpoint: str | None = Field(
        None,
        pattern=r"^https?://[^\s]+$",
        description="OTLP/HTTP traces endpoint of an OpenTelemetry collector (e.g. "
        "http://collector:4318/v1/traces): the gateway also sends its session trace spans there; "
        "none = no export.",
    )
    custom_losses: bool = Field(
        True,
        description="Run the SDK's create_custom_loss losses on the trainer (one round trip per step); "
        "false: the SDK runs them client-side.",
    )

    @model_validator(mode="after")
    def _tls_pair(self) -> GatewayOptions:
        if (self.tls_certfile is None) != (self.tls_keyfile is None):
            raise ValueError("gateway.tls_certfile and gateway.tls_keyfile go together: give both or neither")
        return self


class WatchdogOptions(StrictModel):
    dead_probes: int = Field(
        4,
        le=MAX_DEAD_PROBES,
        description=f"Consecutive 503 probes that end the job; 0 = never exit. Env {DEAD_PROBES_ENV}.",
    )
    probe_interval_s: float = Field(30.0, gt=0, description="Seconds between probes once healthy.")
    startup_probe_interval_s: float = Field(10.0, gt=0, description="Seconds between startup probes.")
    startup_timeout_s: float = Field(3600.0, gt=0, description="Give up if never healthy by then.")

    @field_validator("dead_probes", mode="before")
    @classmethod
    def _count(cls, value: Any) -> int:
        if isinstance(value, str):
            return parse_dead_probes(value, name="watchdog.dead_probes")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{value!r} is not a plain non-negative count")
        return value
