"""How the gateway answers failures: one table from an error's category (miles.errors) to an HTTP status.

The SDK treats a 400 without a body as a proxy rejection and retries it 16 times, so every error the
gateway answers carries a JSON body. Failures never carry a traceback: only the cause's type and message.
"""

from __future__ import annotations

from typing import Any

from miles.errors import Category, MilesError, failure_of

HTTP_STATUS: dict[Category, int] = {
    Category.USER: 400,
    Category.UNAUTHORIZED: 401,
    Category.NOT_FOUND: 404,
    Category.EXPIRED: 410,
    Category.TOO_LARGE: 413,
    Category.CAPACITY: 429,
    Category.NO_CAPACITY: 409,
    Category.SERVER: 500,
    Category.UNKNOWN: 500,
    Category.UPSTREAM: 502,
    Category.UNAVAILABLE: 503,
    Category.TIMEOUT: 504,
}

# The body's `type` (OpenAI: also `code`) unless the error names its own.
DEFAULT_KIND: dict[Category, str] = {
    Category.USER: "invalid_request_error",
    Category.UNAUTHORIZED: "auth_error",
    Category.NOT_FOUND: "not_found_error",
    Category.EXPIRED: "gone",
    Category.TOO_LARGE: "request_too_large",
    Category.CAPACITY: "rate_limit_error",
    Category.NO_CAPACITY: "capacity_error",
    Category.SERVER: "server_error",
    Category.UNKNOWN: "server_error",
    Category.UNAVAILABLE: "server_error",
    Category.UPSTREAM: "server_error",
    Category.TIMEOUT: "timeout",
}


class ApiError(MilesError):
    """An error a route answers directly (not through a future); `kind` overrides the body's type."""

    def __init__(self, category: Category, message: str, *, kind: str | None = None) -> None:
        super().__init__(message, category=category)
        self.message = message
        self.kind = kind or DEFAULT_KIND[category]

    @property
    def status(self) -> int:
        return HTTP_STATUS[self.category]


def answer_for(exc: MilesError) -> tuple[int, str, str]:
    """(status, message, kind) for an error of the family that reached the HTTP layer."""
    if isinstance(exc, ApiError):
        return exc.status, exc.message, exc.kind
    # An error class may name its own kind (e.g. StateStoreUnavailable: "state_store_unavailable").
    kind = getattr(exc, "kind", None) or DEFAULT_KIND[exc.category]
    return HTTP_STATUS[exc.category], exc.public_message(), kind


def not_found(what: str) -> ApiError:
    return ApiError(Category.NOT_FOUND, f"{what} not found")


def bad_request(message: str) -> ApiError:
    return ApiError(Category.USER, message)


def describe_failure(exc: BaseException) -> tuple[str, Category]:
    """(message, category) for a failed operation: the cause's type and message, never a traceback."""
    found = failure_of(exc)
    if found is not None:
        return found.public_message(), found.category
    cause = exc
    # Ray wraps remote exceptions; report the innermost cause the caller can act on.
    while getattr(cause, "cause", None) is not None and cause.cause is not cause:  # type: ignore[attr-defined]
        cause = cause.cause  # type: ignore[attr-defined]
    text = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
    name = type(cause).__name__
    return (f"{name}: {text}" if text else name), Category.SERVER


def extras_for(exc: MilesError | None) -> tuple[dict[str, Any] | None, dict[str, str] | None]:
    """(details, headers) beyond status and message: an error's structured `details` (a capacity error:
    the model, what was asked, what is free) for the JSON body, and `x-should-retry: false` for errors
    that retrying at once cannot fix (the SDK otherwise retries a 409 like a lock timeout)."""
    if exc is None:
        return None, None
    details = getattr(exc, "details", None)
    headers = {"x-should-retry": "false"} if exc.category in NO_RETRY else None
    return (details if isinstance(details, dict) else None), headers


NO_RETRY = frozenset({Category.NO_CAPACITY})
