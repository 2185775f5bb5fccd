"""The environment of every process stoker starts: a launcher's agents and ranks (torchrun,
the Ray driver), an evaluation or an export (``launch.child``). What ties a process to its
launcher (the gang id, the lifeline token and heartbeat) is added by the gang that starts it
(``launch.gang.gang_env``): each launch gets its own."""

from __future__ import annotations

import json
import os

from stoker.config import RunConfig
from stoker.launch.gang import GRACE_SECONDS, RANK_STOP_MARGIN_SECONDS
from stoker.storage import credentials

STOP_GRACE_ENV = "STOKER_STOP_GRACE_SECONDS"  # the ranks' stop budget (training.distributed.stop_grace_seconds)
STORAGE_OPTIONS_ENV = "STOKER_STORAGE_OPTIONS"  # fsspec options of the store, as JSON


def child_env(cfg: RunConfig) -> dict[str, str]:
    """The environment of every process the launcher or an evaluation starts."""
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env[STORAGE_OPTIONS_ENV] = json.dumps(cfg.storage.storage_options)
    if cfg.launch.rdzv_host in ("127.0.0.1", "localhost"):
        env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if cfg.launch.num_nodes > 1:
        # a fresh store for each rendezvous round, hosted by that round's rank 0: a store shared
        # by all rounds keeps the old round's keys, and the restart count that could tell the
        # rounds apart differs between nodes (see training.train.any_rank_restarted)
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    env.pop("PREFECT__FLOW_RUN_ID", None)
    env[STOP_GRACE_ENV] = str(_rank_stop_grace(env.get(STOP_GRACE_ENV)))
    return credentials.apply_to_env(env)  # a credentials block's keys, as AWS_* variables


def _rank_stop_grace(requested: str | None) -> float:
    """The ranks' stop budget: what was asked for, but never past the launcher's grace."""
    ceiling = GRACE_SECONDS - RANK_STOP_MARGIN_SECONDS
    try:
        return min(float(requested), ceiling) if requested else ceiling
    except ValueError:
        return ceiling
