"""Errors of trainer commands, carrying the remote cause across Ray.

Ray wraps a remote exception in RayTaskError (whose `cause` is the user's exception and whose
`traceback_str` is the remote traceback); a dead actor surfaces as RayActorError/ActorDiedError. Only the
RayTaskError transport wrapper is peeled off: the caller sees the user exception's type name and message
(e.g. "UserError: datum 3: ..."), or the actor error itself (e.g. "ActorDiedError: ..."). The error keeps
its cause's category (miles.errors): a trainer's UserError reaches the client as a user error.
"""

from __future__ import annotations

import traceback

from ray.exceptions import RayTaskError

from miles.errors import Category, MilesError, category_of


class RemoteCommandError(MilesError, RuntimeError):
    """A trainer command failed; `category` is its cause's (`is_user_error`: the caller was at fault)."""

    def __init__(
        self,
        method: str,
        cause_type: str,
        cause_message: str,
        remote_traceback: str = "",
        *,
        is_user_error: bool = False,
        category: Category | None = None,
    ) -> None:
        if category is None:
            category = Category.USER if is_user_error else type(self).category
        super().__init__(f"trainer command {method} failed: {cause_type}: {cause_message}", category=category)
        self.method = method
        self.cause_type = cause_type
        self.cause_message = cause_message
        self.remote_traceback = remote_traceback

    @property
    def is_user_error(self) -> bool:
        return self.category.reported == "user"

    def public_message(self) -> str:
        return self.cause

    def __reduce__(self):
        args = (self.method, self.cause_type, self.cause_message, self.remote_traceback)
        return (_rebuild, (type(self), args, self.category))

    @property
    def cause(self) -> str:
        """`Type: message`, as shown by health_problem()."""
        return f"{self.cause_type}: {self.cause_message}"

    @classmethod
    def from_exception(cls, method: str, exc: BaseException) -> RemoteCommandError:
        if isinstance(exc, RemoteCommandError):
            return exc
        remote_tb = ""
        while isinstance(exc, RayTaskError) and exc.cause is not None and exc.cause is not exc:
            # as_instanceof_cause() copies keep the remote traceback only in their str()
            remote_tb = remote_tb or vars(exc).get("traceback_str") or str(exc)
            exc = exc.cause
        if not remote_tb:
            remote_tb = "".join(traceback.format_exception(exc))
        return cls(
            method,
            type(exc).__name__,
            _message(exc),
            remote_tb,
            category=category_of(exc),
        )


class TrainerUnavailableError(RemoteCommandError):
    """No alive trainer cell can take the command (a Tinker future reports it as "server")."""

    category = Category.UNAVAILABLE

    def __init__(self, method: str, reason: str) -> None:
        super().__init__(method, "TrainerUnavailableError", reason)

    def __reduce__(self):
        return (type(self), (self.method, self.cause_message))


def _rebuild(kind: type[RemoteCommandError], args: tuple, category: Category) -> RemoteCommandError:
    return kind(*args, category=category)


def _message(exc: BaseException) -> str:
    # a RayTaskError subclass built by as_instanceof_cause() stringifies to the whole wrapper text
    text = str(exc)
    return text if text else repr(exc)
