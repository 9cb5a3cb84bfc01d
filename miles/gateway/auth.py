"""API keys: each key is a tenant. Tinker sends `X-API-Key`, OpenAI clients `Authorization: Bearer`.

Keys come from a file (one `KEY` or `KEY TENANT` per line, `#` comments) or an environment variable
(comma/whitespace separated). Every comparison runs `hmac.compare_digest` against every known key, so the
time taken does not depend on which key (if any) matched.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from pathlib import Path

KEY_PREFIX = "tml-"  # the SDK refuses any other key before sending it
_TENANT_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def generate_api_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def default_tenant(key: str) -> str:
    return "tenant-" + hashlib.sha256(key.encode()).hexdigest()[:12]


class ApiKeys:
    def __init__(self, keys: dict[str, str]) -> None:
        """`keys`: api key -> tenant name."""
        for key, tenant in keys.items():
            if not key.startswith(KEY_PREFIX) or len(key) < len(KEY_PREFIX) + 8:
                raise ValueError(f"API keys must start with {KEY_PREFIX!r} and be at least 12 characters")
            if not _TENANT_RE.fullmatch(tenant):
                raise ValueError(f"tenant name {tenant!r} must match {_TENANT_RE.pattern}")
        if not keys:
            raise ValueError("no API keys configured: give a key file or set the keys' environment variable")
        self._entries = [(key.encode(), tenant) for key, tenant in keys.items()]

    @classmethod
    def from_lines(cls, lines: list[str], *, source: str) -> ApiKeys:
        keys: dict[str, str] = {}
        for number, raw in enumerate(lines, 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) > 2:
                raise ValueError(
                    f"{source}:{number}: expected 'KEY' or 'KEY TENANT', got {len(parts)} fields"
                )
            if len(parts) == 2 and parts[1].startswith(KEY_PREFIX):
                raise ValueError(
                    f"{source}:{number}: {parts[1][:8]}... looks like a second key, not a tenant name; "
                    "put one key per line (or separate keys with commas)"
                )
            keys[parts[0]] = parts[1] if len(parts) == 2 else default_tenant(parts[0])
        return cls(keys)

    @classmethod
    def from_file(cls, path: str | Path) -> ApiKeys:
        file = Path(path).expanduser().resolve()
        if not file.is_file():
            raise ValueError(f"API key file {file} does not exist")
        return cls.from_lines(file.read_text().splitlines(), source=str(file))

    @classmethod
    def from_env(cls, var: str) -> ApiKeys:
        value = os.environ.get(var, "")
        return cls.from_lines(re.split(r"[,\s]+", value), source=f"${var}")

    def tenant_for(self, presented: str | None) -> str | None:
        """The tenant of `presented`, or None; constant time in which key matched."""
        candidate = (presented or "").encode()
        found: str | None = None
        for key, tenant in self._entries:
            if hmac.compare_digest(key, candidate):
                found = tenant
        return found

    def first_key(self) -> str:
        """The first key configured: what the job's own client (the self-test) presents."""
        return self._entries[0][0].decode()

    @property
    def tenants(self) -> set[str]:
        return {tenant for _, tenant in self._entries}


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None
