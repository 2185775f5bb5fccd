"""Connecting to the Ray cluster that ``ray.address`` names, or starting a local Ray on
127.0.0.1: one way for the data engine (data.ray_engine) and the training driver
(training.ray_main). Ray is imported only when called (it is an optional extra)."""

from __future__ import annotations

import logging
import os
import socket
from typing import Any


def start_local(num_cpus: int, **init_kwargs: Any) -> Any:
    """A Ray instance for this job, stopped by ``ray.shutdown()``. Ray turns a loopback node
    address into the host's outward one unless it believes it runs on a laptop; its own switch
    for that is flipped for the start only, so every Ray server listens on 127.0.0.1 alone.
    Its workers run at nice 0 (Ray's default is 15, meant for shared cluster nodes): they are
    this job's own work and share the host as torchrun's ranks do. RAY_worker_niceness set by
    the caller wins; set here, it is only in the environment of the start (Ray's processes
    read it then), not in the caller's afterwards (a notebook's)."""
    import ray

    niceness_was_set = "RAY_worker_niceness" in os.environ
    os.environ.setdefault("RAY_worker_niceness", "0")

    try:
        from ray._private import ray_constants
    except ImportError:  # another Ray layout: its default node address
        ray_constants = None
    saved = getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
    if saved is not None:
        ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        return ray.init(
            address="local", _node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=num_cpus, **init_kwargs
        )
    finally:
        if saved is not None:
            ray_constants.ENABLE_RAY_CLUSTER = saved
        if not niceness_was_set:
            os.environ.pop("RAY_worker_niceness", None)


def connect(address: str, **init_kwargs: Any) -> Any:
    """Join the cluster at `address` (ray://HOST:PORT, auto, HOST:PORT); one ConnectionError
    naming ray.address when it cannot be reached (Ray itself retries a GCS for minutes)."""
    import ray

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        if address != "auto" and not address.startswith("ray://"):
            host, _, port = address.rpartition(":")
            socket.create_connection((host.strip("[]"), int(port)), timeout=10).close()
        return ray.init(address=address, logging_level=logging.WARNING, **init_kwargs)
    except (ConnectionError, TimeoutError, OSError) as err:
        raise ConnectionError(
            f"ray.address: cannot reach the Ray cluster at {address} ({err}); start "
            "it, or fix ray.address (ray://HEAD:10001, or auto on a node)."
        ) from None
