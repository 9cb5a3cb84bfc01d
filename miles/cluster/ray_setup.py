"""Ray bring-up for the driver: connect to the job's cluster, and who is the head node."""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Mapping
from pathlib import Path

import ray

from miles.errors import Category, MilesError

logger = logging.getLogger(__name__)

HEAD_RESOURCE = "node:__internal_head__"
DEFAULT_CONNECT_TIMEOUT_S = 60.0


class RayConnectError(MilesError, ConnectionError):
    """The driver could not join the job's Ray cluster; the message says what was tried."""

    category = Category.UNAVAILABLE


def connect(
    address: str | None = None, *, namespace: str = "miles", timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
) -> None:
    """Join the Ray cluster the job script started (`address`, else RAY_ADDRESS, else "auto").

    Never starts a new cluster: a driver that cannot find the job's cluster must fail, not run alone.
    Bounded: ray.init retries an absent GCS for many minutes, so it runs in a daemon thread that is
    abandoned after `timeout_s` (the driver then exits; a stuck thread does not hold it).
    """
    if ray.is_initialized():
        return
    target = address or os.environ.get("RAY_ADDRESS") or "auto"
    if problem := auth_token_problem(os.environ):
        raise RayConnectError(f"cannot join the Ray cluster at {target}: {problem}")
    outcome: list[BaseException | None] = []

    def attempt() -> None:
        try:
            ray.init(address=target, namespace=namespace, log_to_driver=True)
            outcome.append(None)
        except BaseException as exc:  # handed to the caller's thread
            outcome.append(exc)

    thread = threading.Thread(target=attempt, name="ray-connect", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        raise RayConnectError(
            f"no Ray cluster answered at {target} within {timeout_s:g} s ({listening(target)}): the job's "
            "`ray start --head` failed or uses another port; see the Ray logs under the run's logs/ "
            "(bound: runtime.ray_connect_timeout_s)"
        )
    if outcome[0] is not None:
        raise RayConnectError(f"could not join the Ray cluster at {target}: {outcome[0]}") from outcome[0]
    logger.info("connected to Ray at %s (namespace %s)", target, namespace)


def auth_token_problem(env: Mapping[str, str]) -> str | None:
    """Why the job's Ray token cannot be presented, or None. Without this check a driver with an unreadable
    token retries an answering GCS until its timeout, and only Ray's log says "Unauthenticated"."""
    if env.get("RAY_AUTH_MODE", "").lower() != "token" or env.get("RAY_AUTH_TOKEN"):
        return None
    path = env.get("RAY_AUTH_TOKEN_PATH")
    if not path:
        return "RAY_AUTH_MODE=token but neither RAY_AUTH_TOKEN nor RAY_AUTH_TOKEN_PATH is set"
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        return f"the job's Ray token {path} (RAY_AUTH_TOKEN_PATH) cannot be read: {exc.strerror or exc}"
    if not token:
        return f"the job's Ray token {path} (RAY_AUTH_TOKEN_PATH) is empty"
    return None


def listening(address: str) -> str:
    """Whether anything accepts TCP at `host:port` (what a stuck ray.init does not say)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return "address resolved by Ray"
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return f"something listens on {address}, but it is not this job's GCS"
    except OSError as exc:
        return f"nothing accepts connections on {address}: {exc.strerror or exc}"


def alive_nodes() -> list[dict]:
    return [node for node in ray.nodes() if node.get("Alive")]


def head_node_ip() -> str | None:
    """IP of the alive node that carries Ray's head resource, or None if no alive node has it."""
    for node in alive_nodes():
        if HEAD_RESOURCE in node.get("Resources", {}):
            return node["NodeManagerAddress"]
    return None
