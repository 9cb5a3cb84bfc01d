"""The catalog's errors: each names what was asked and what to do, and carries its category."""

from __future__ import annotations

from typing import Any

from miles.errors import Category, MilesError, NotFoundError, UnavailableError, UserError


class CapacityError(MilesError):
    """The pool cannot hold the instance a request needs. No queue, no preemption: it fails at once.

    `details` is the JSON body's payload: the model, what was asked, and what is free per node."""

    category = Category.NO_CAPACITY
    kind = "capacity_error"

    def __init__(self, model: str, train_mode: str, gpus: int, free_by_node: dict[str, int]) -> None:
        free = ", ".join(f"{node}: {n}" for node, n in free_by_node.items()) or "no pool nodes"
        super().__init__(
            f"no capacity for model {model!r} ({train_mode}): a new instance needs {gpus} GPU(s) on one "
            f"node; free GPUs by node: {free}. Release a handle (or wait for idle ones to expire) and retry"
        )
        self.details: dict[str, Any] = {
            "model": model,
            "train_mode": train_mode,
            "asked": {"gpus_on_one_node": gpus},
            "free": dict(free_by_node),
        }

    def public_message(self) -> str:
        return str(self)  # the whole text: it says what is free, which the caller needs to decide


class HandleExpired(MilesError):
    """An operation on a model handle that has ended (idle, lifetime, release, its instance lost)."""

    category = Category.EXPIRED
    kind = "handle_expired"

    def public_message(self) -> str:
        return str(self)


class StaleEpoch(HandleExpired):
    """An operation admitted under an instance epoch that has since been restarted or replaced."""

    kind = "stale_epoch"


class ControllerSuperseded(UnavailableError):
    """Another controller recovered the allocation state: this (stale) one must not write it any more."""


class UnknownCatalogModel(NotFoundError):
    """A base_model the catalog does not list."""


class TrainModeNotAllowed(UserError):
    """The catalog entry does not allow the train mode (or LoRA rank) asked for."""
