"""One error family: every error miles raises on purpose is a `MilesError` with a `Category`.

The category says whose move it is (the caller's, ours, or nobody's until capacity frees up); the gateway
maps it to an HTTP status in one table (`miles.gateway.errors.HTTP_STATUS`) and, for a failed Tinker
future, to the three categories the Tinker SDK knows (`Category.reported`). Errors that cross Ray keep
their category (`miles.train.errors.RemoteCommandError` carries its cause's).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

# What a failed Tinker future reports: the SDK's RequestErrorCategory has exactly these.
ReportedCategory = Literal["user", "server", "unknown"]


class Category(StrEnum):
    USER = "user"  # the request is wrong: fix it and send it again
    NOT_FOUND = "not_found"  # no such thing (or not the caller's)
    UNAUTHORIZED = "unauthorized"  # no key, or an unknown one
    EXPIRED = "expired"  # it existed and has ended (a session): start a new one
    TOO_LARGE = "too_large"  # the request is bigger than this server takes: send less per request
    CAPACITY = "capacity"  # over a limit of this server: try again later
    NO_CAPACITY = "no_capacity"  # the device pool cannot hold the instance asked for: no queue, fails now
    TIMEOUT = "timeout"  # the work did not finish within its time limit
    UNAVAILABLE = "unavailable"  # the runtime cannot serve now (no alive trainer, engine down)
    UPSTREAM = "upstream"  # the runtime answered something unusable (e.g. fewer samples than asked)
    SERVER = "server"  # our fault
    UNKNOWN = "unknown"  # a failure without a cause

    @property
    def reported(self) -> ReportedCategory:
        """The Tinker SDK's category: the caller's fault is "user", everything else ours."""
        if self in _CALLER_FAULTS:
            return "user"
        return "unknown" if self is Category.UNKNOWN else "server"


_CALLER_FAULTS = frozenset(
    {Category.USER, Category.NOT_FOUND, Category.UNAUTHORIZED, Category.EXPIRED} | {Category.TOO_LARGE}
)


class MilesError(Exception):
    """Base of the family. `category` defaults to the class's; an instance may carry another."""

    category: Category = Category.SERVER  # the class's default; pickling keeps an instance's own

    def __init__(self, message: str = "", *, category: Category | None = None) -> None:
        super().__init__(message)
        if category is not None:
            self.category = category

    def public_message(self) -> str:
        """What a client is told: the message for the caller's faults, else the type and first line."""
        text = str(self).strip()
        if self.category.reported == "user":
            return text
        first = text.splitlines()[0] if text else ""
        return f"{type(self).__name__}: {first}" if first else type(self).__name__


class UserError(MilesError, ValueError):
    """A problem with the caller's input (bad batch, unknown loss, bad config): category "user"."""

    category = Category.USER


class NotFoundError(UserError, LookupError):
    category = Category.NOT_FOUND


class TooLargeError(UserError):
    """A request (its body, decompressed body or decoded tensors) over the gateway's size limit."""

    category = Category.TOO_LARGE


class UnavailableError(MilesError):
    category = Category.UNAVAILABLE


class UpstreamError(MilesError, RuntimeError):
    category = Category.UPSTREAM


class IllegalTransition(MilesError, RuntimeError):
    """A state machine (engine cell, trainer cell, future, session) was asked to move along an edge its
    transition table does not have: a bug in the caller, or a race that lost."""


def category_of(exc: BaseException) -> Category:
    """The category of the innermost family member along `exc`'s causes; "server" when there is none."""
    found = failure_of(exc)
    return found.category if found is not None else Category.SERVER


def failure_of(exc: BaseException) -> MilesError | None:
    """The innermost family member along `exc`'s `.cause` chain (Ray's wrappers), or None."""
    found: MilesError | None = None
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, MilesError):
            found = current
        seen.add(id(current))
        nxt = getattr(current, "cause", None)
        current = nxt if isinstance(nxt, BaseException) else None
    return found
