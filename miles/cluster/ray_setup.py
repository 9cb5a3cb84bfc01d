"""Ray bring-up for the driver: connect to the job's cluster, and who is the head node."""

from __future__ import annotations

import logging
import os

import ray

logger = logging.getLogger(__name__)

HEAD_RESOURCE = "node:__internal_head__"


def connect(address: str | None = None, *, namespace: str = "miles") -> None:
    """Join the Ray cluster the job script started (`address`, else RAY_ADDRESS, else "auto").

    Never starts a new cluster: a driver that cannot find the job's cluster must fail, not run alone.
    """
    if ray.is_initialized():
        return
    target = address or os.environ.get("RAY_ADDRESS") or "auto"
    ray.init(address=target, namespace=namespace, log_to_driver=True)
    logger.info("connected to Ray at %s (namespace %s)", target, namespace)


def alive_nodes() -> list[dict]:
    return [node for node in ray.nodes() if node.get("Alive")]


def head_node_ip() -> str | None:
    """IP of the alive node that carries Ray's head resource, or None if no alive node has it."""
    for node in alive_nodes():
        if HEAD_RESOURCE in node.get("Resources", {}):
            return node["NodeManagerAddress"]
    return None
