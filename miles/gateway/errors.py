"""HTTP errors with JSON bodies, and the mapping of runtime failures to Tinker error categories.

The SDK treats a 400 without a body as a proxy rejection and retries it 16 times, so every error the
gateway answers carries a JSON body. Failures never carry a traceback: only the cause's type and message.
"""

from __future__ import annotations

from miles.state.records import FailureCategory
from miles.types import UserError

Category = FailureCategory  # what a failed future reports


class ApiError(Exception):
    """An error answered directly with an HTTP status (not through a future)."""

    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind


def not_found(what: str) -> ApiError:
    return ApiError(404, f"{what} not found", kind="not_found_error")


def bad_request(message: str) -> ApiError:
    return ApiError(400, message)


def describe_failure(exc: BaseException) -> tuple[str, Category]:
    """(message, category) for a failed operation: the cause's type and message, never a traceback."""
    if isinstance(exc, UserError):
        return str(exc), "user"
    if isinstance(getattr(exc, "cause_type", None), str):  # a trainer command's remote cause (miles.train)
        category: Category = "user" if getattr(exc, "is_user_error", False) else "server"
        return f"{exc.cause_type}: {exc.cause_message}", category  # type: ignore[attr-defined]
    cause = exc
    # Ray wraps remote exceptions; report the innermost cause the caller can act on.
    while getattr(cause, "cause", None) is not None and cause.cause is not cause:  # type: ignore[attr-defined]
        cause = cause.cause  # type: ignore[attr-defined]
    if isinstance(cause, UserError):
        return str(cause), "user"
    text = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
    name = type(cause).__name__
    return (f"{name}: {text}" if text else name), "server"
