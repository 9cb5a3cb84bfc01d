"""Signed download URLs for external weights: the link itself is the credential, as the hosted service's
signed URLs are (the SDK's download helper fetches them with a plain GET, no API key).

A signature is an HMAC-SHA256 over the file's address and the expiry, with a key only this gateway holds;
it proves that a caller allowed to read the checkpoint asked for the link, and until when it is valid.
Pure functions: the caller supplies the key and the clock.
"""

from __future__ import annotations

import hashlib
import hmac
from urllib.parse import quote


def _message(address: str, expires: int) -> bytes:
    return f"{address}\n{expires}".encode()


def signature(key: bytes, address: str, expires: int) -> str:
    """The hex signature of `address` (e.g. `model/external_weights/name/file`) valid until `expires`."""
    return hmac.new(key, _message(address, expires), hashlib.sha256).hexdigest()


def is_valid(key: bytes, address: str, expires: int, given: str, now: float) -> bool:
    """The signature matches (compared in constant time) and the expiry has not passed."""
    # as bytes: compare_digest raises TypeError on a str with non-ASCII characters (a fuzzed query: 500)
    expected = signature(key, address, expires).encode()
    return now < expires and hmac.compare_digest(expected, given.encode("utf-8", "surrogatepass"))


def signed_path(prefix: str, address: str, key: bytes, expires: int) -> str:
    """`prefix/address?expires=..&signature=..` with the address percent-encoded per segment."""
    return f"{prefix}/{quote(address)}?expires={expires}&signature={signature(key, address, expires)}"
