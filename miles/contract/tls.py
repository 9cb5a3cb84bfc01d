"""How a client trusts the job's gateway when it serves https with a site's own certificate: that exact
certificate, pinned (the watchdog on the head and `launcher status` on a login node both probe it)."""

from __future__ import annotations

import ssl
from pathlib import Path


def pinned_tls(certfile: Path) -> ssl.SSLContext:
    """Trust exactly the gateway's own certificate (chain). The job probes the head by IP, which a site
    certificate rarely names, so the host name is not checked: the pinned certificate is the check."""
    context = ssl.create_default_context(cafile=str(certfile))
    context.check_hostname = False
    context.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN  # a CA-issued leaf is its own anchor here
    return context
