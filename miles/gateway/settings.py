"""Gateway settings (timeouts, long-poll, limits), with the environment overrides the issue names."""

from __future__ import annotations

import os

from pydantic import BaseModel, Field

from miles.contract.preset.gateway import DEFAULT_MAX_BODY_MB
from miles.state.claims import claim_ttl_s

DEFAULT_MAX_BODY_BYTES = DEFAULT_MAX_BODY_MB << 20


def _openai_timeout_default() -> float:
    raw = os.environ.get("MILES_OPENAI_SAMPLE_TIMEOUT", "1800")
    try:
        value = float(raw)
    except ValueError as exc:
        raise ValueError(f"MILES_OPENAI_SAMPLE_TIMEOUT must be a number of seconds, got {raw!r}") from exc
    if value <= 0:
        raise ValueError(f"MILES_OPENAI_SAMPLE_TIMEOUT must be positive, got {raw!r}")
    return value


class GatewaySettings(BaseModel):
    # retrieve_future waits this long for a result before `try_again`; the SDK's read timeout is 45 s.
    long_poll_s: float = Field(25.0, gt=0, lt=45)
    # An operation waiting for a missing seq_id fails after this long.
    seq_gap_timeout_s: float = Field(120.0, gt=0)
    queue_timeout_s: float = Field(600.0, gt=0)
    execution_timeout_s: float = Field(3600.0, gt=0)
    # Sessions whose last heartbeat is older than this are expired (the SDK beats every 10 s).
    session_timeout_s: float = Field(300.0, gt=0)
    # How often the gateway looks for silent sessions to expire (and release their models).
    session_sweep_s: float = Field(30.0, gt=0)
    # Past this fraction of the checkpoint filesystem used, each sweep sets miles_checkpoint_fs_warning and
    # the first logs a warning (docs/gateway.md "Checkpoint storage").
    checkpoint_fs_warn_fraction: float = Field(0.9, gt=0, le=1)
    future_ttl_s: float = Field(86400.0, gt=0)
    openai_sample_timeout_s: float = Field(default_factory=_openai_timeout_default, gt=0)
    max_concurrent_samples: int = Field(64, gt=0)
    # advertised in /client/config: the SDK then zstd-compresses forward_backward bodies (accepted either way)
    proto_compress_fwdbwd: bool = True
    fwdbwd_max_chunk_len: int | None = Field(None, gt=0)
    # advertised in /client/config: the SDK then uploads create_custom_loss graphs and forward_backward_custom
    # runs them here in one round trip; off, the SDK runs them client-side (two round trips)
    custom_loss_server_side: bool = True
    # an OTLP/HTTP traces endpoint (http://collector:4318/v1/traces): session trace spans are sent there too
    otel_endpoint: str | None = None
    request_log_path: str | None = None  # JSONL of every request (conformance tests)
    # A request body over this many bytes is refused with 413, and so is a zstd forward_backward body that
    # decompresses to more, or one whose tensors decode to more (sparse CSR made dense). The SDK sends
    # forward_backward in chunks of about 5 MB before compression; one long datum can be larger.
    max_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, gt=0)

    @property
    def dedup_claim_ttl_s(self) -> float:
        return claim_ttl_s(self.queue_timeout_s, self.execution_timeout_s)
