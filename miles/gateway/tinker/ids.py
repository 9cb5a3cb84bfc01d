"""The identifiers a Tinker client sends back: one validated type, used by every body and path that has one.

Every id the gateway hands out (`sess-...`, `req-...`, `<session>:train:<n>`, `<session>:sample:<n>`) is
made of these characters, so an id outside them, empty, or longer than `MAX_ID_CHARS` names nothing. It is
refused as a malformed request (400, naming the field) before any lookup: the state store refuses an empty
key with a ValueError, which used to answer 500. A well-formed id that names nothing of the caller's is
a 404, the same answer whether it is another tenant's or nobody's.
"""

from __future__ import annotations

import re
from typing import Annotated, TypeGuard

from pydantic import StringConstraints

from miles.errors import UserError

MAX_ID_CHARS = 256
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]*$"
_ID_RE = re.compile(ID_PATTERN)

Identifier = Annotated[str, StringConstraints(min_length=1, max_length=MAX_ID_CHARS, pattern=ID_PATTERN)]
SessionId = Identifier
ModelId = Identifier
RequestId = Identifier
SamplerId = Identifier


def is_identifier(value: object) -> TypeGuard[str]:
    return isinstance(value, str) and len(value) <= MAX_ID_CHARS and _ID_RE.fullmatch(value) is not None


def check_identifier(value: str, field: str) -> str:
    """`value` if it is a well-formed id; else a UserError that names `field` and the rule."""
    if not is_identifier(value):
        shown = value if len(value) <= 40 else value[:40] + "..."
        raise UserError(
            f"{field} {shown!r} is not an id this gateway issued: 1-{MAX_ID_CHARS} characters of "
            "letters, digits, '.', '_', ':', '-', starting with a letter or digit"
        )
    return value
