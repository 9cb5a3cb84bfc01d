"""Handle leases: a tenant's hold on an instance slot, and when it ends.

Idle expiry counts business inactivity only (training and sampling operations call `touch`); a
session's heartbeat never touches a lease. The maximum lifetime counts from creation, whatever happens.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

ExpiryReason = Literal["idle", "lifetime"]


@dataclass(frozen=True)
class Lease:
    model_id: str  # the tinker model id (the handle)
    base_model: str
    train_mode: str
    instance_id: str
    epoch: int
    created_at: float  # wall-clock seconds: leases outlive a controller restart
    last_active_at: float
    idle_timeout_s: float
    max_lifetime_s: float | None

    def touched(self, now: float) -> Lease:
        return replace(self, last_active_at=max(self.last_active_at, now))

    def idle_s(self, now: float) -> float:
        return max(0.0, now - self.last_active_at)

    def expiry(self, now: float) -> ExpiryReason | None:
        """Why the lease has ended at `now`, or None. Lifetime first: it is the harder limit."""
        if self.max_lifetime_s is not None and now - self.created_at >= self.max_lifetime_s:
            return "lifetime"
        if self.idle_s(now) >= self.idle_timeout_s:
            return "idle"
        return None

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Lease:
        return cls(**data)


def expiry_text(lease: Lease, reason: ExpiryReason) -> str:
    if reason == "lifetime":
        return f"expired: it reached its maximum lifetime of {lease.max_lifetime_s:g} s"
    return (
        f"expired: it had no training or sampling operation for {lease.idle_timeout_s:g} s (idle_timeout_s)"
    )
