"""`ray:`: per-job ports, the temp dir and how node IPs are chosen."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from miles.contract.preset.base import Port, StrictModel

# Ray's AF_UNIX socket paths live under the temp dir and must stay below 107 bytes; the session
# directory and socket names Ray appends take about 70 of them.
MAX_RAY_TEMP_DIR_LEN = 32


class NodeIpOptions(StrictModel):
    mode: Literal["hostname", "interface", "prefix", "loopback-index"] = Field(
        "hostname",
        description="hostname: resolve the node name; interface: the IPv4 of `interface` on each node; "
        "prefix: the node's IPv4 starting with `prefix`; loopback-index (TEST MODE): node i of the "
        "allocation gets 127.0.0.(2+i).",
    )
    interface: str | None = Field(None, description="Network interface name (mode interface).")
    prefix: str | None = Field(None, description="Address prefix such as `10.1.` (mode prefix).")

    @model_validator(mode="after")
    def _needs(self) -> NodeIpOptions:
        if self.mode == "interface" and not self.interface:
            raise ValueError("mode 'interface' needs 'interface' (e.g. ib0)")
        if self.mode == "prefix" and not self.prefix:
            raise ValueError("mode 'prefix' needs 'prefix' (e.g. '10.1.')")
        return self


class RayOptions(StrictModel):
    """Ray bring-up: per-job ports so jobs sharing nodes never collide, and a short temp dir.

    A port left unset is picked free when the job starts, on the node that binds it, and claimed there
    (`<ray.temp_dir>-ports/`) so that two jobs starting at once never pick the same one; the ports a job
    uses are written to `<run_dir>/ports/` and shown by `launcher status`.
    """

    gcs_port: Port | None = Field(None, description="GCS port of the head; none = picked per job.")
    client_server_port: Port | None = Field(
        None, description="Ray client server port of the head; none = picked per job."
    )
    node_port_base: Port | None = Field(
        None,
        description="Fixed plan: node i uses base+10i .. base+10i+5 (node manager, object manager, agents, "
        "metrics); none = each node picks 6 free ports.",
    )
    worker_port_base: Port | None = Field(
        None, description="Fixed plan: node i's workers use base+i*span .. +span-1; none = picked per node."
    )
    worker_ports_per_node: int = Field(200, ge=16, description="Worker port span per node.")
    temp_dir: str = Field(
        "/tmp/miles-ray", description=f"Base of the per-job temp dirs (at most {MAX_RAY_TEMP_DIR_LEN} chars)."
    )
    num_cpus: int | None = Field(None, ge=1, description="CPUs Ray advertises per node; none = detected.")
    object_store_memory_mb: int | None = Field(None, ge=64, description="Object store size; none = Ray's.")
    start_timeout_s: float = Field(300.0, gt=0, description="Bound on waiting for every node to join.")
    node_ip: NodeIpOptions = Field(default_factory=NodeIpOptions, description="How node IPs are chosen.")

    @field_validator("temp_dir")
    @classmethod
    def _temp_dir(cls, value: str) -> str:
        if not value.startswith("/") or len(value) > MAX_RAY_TEMP_DIR_LEN:
            raise ValueError(
                f"must be an absolute path of at most {MAX_RAY_TEMP_DIR_LEN} characters "
                "(Ray's socket paths below it are limited to 107 bytes)"
            )
        return value
