"""The Ray launcher (``launch.launcher: ray``): the ranks run as Ray Train workers on the cluster
at ``ray.address`` (or a local Ray started for the launch). This side never imports Ray or
torch: it runs the driver (``python -m stoker.training.ray_main``) as a one-process gang, so its
output, watchdog, stop and kill are the torchrun launcher's, and reads the driver's result
file to say why the launch ended.

The driver prints every worker's lines in torchrun's ``[default<rank>]:`` form, so the stream
carries the same rank prefixes and events. A stop (SIGTERM to the driver, from the gang's stop)
is relayed to the workers, which stop at a step boundary with a stop checkpoint; when the driver
ends, Ray ends its workers with it (they are the driver's job), so nothing is left behind even
after the gang's SIGKILL.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

from stoker.config import LaunchConfig, RunConfig
from stoker.contracts.events import Failure, from_dict
from stoker.launch.base import GangResult
from stoker.launch.env import child_env
from stoker.launch.gang import GangLauncher, ProcessGang, make_work_dir

RESULT_FILE = "ray-result.json"


def driver_command(config_url: str, shard_key: str, resume_key: str | None, result_path: str) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "stoker.training.ray_main",
        "--config",
        config_url,
        "--shards",
        shard_key,
        "--result",
        result_path,
    ]
    if resume_key:
        cmd += ["--resume-from", resume_key]
    return cmd


class RayLauncher(GangLauncher):
    """One launch attempt on Ray: `launch.world_size` workers (num_nodes x nproc_per_node)."""

    def __init__(
        self, cfg: RunConfig, config_url: str, shard_key: str, resume_key: str | None, env: dict[str, str] | None = None
    ):
        self.launch: LaunchConfig = cfg.launch
        self.address = cfg.ray.address
        self.work_dir = make_work_dir("stoker-ray-launch-")
        self.result_path = os.path.join(self.work_dir, RESULT_FILE)
        self.cmd = driver_command(config_url, shard_key, resume_key, self.result_path)
        base = dict(env if env is not None else child_env(cfg))
        # Ray's own forwarding of worker output is off (the driver relays it); these keep what
        # Ray itself prints plain
        base.update(
            RAY_DEDUP_LOGS="0",
            RAY_COLOR_PREFIX="0",
            RAY_USAGE_STATS_ENABLED="0",
            RAY_TRAIN_V2_ENABLED=base.get("RAY_TRAIN_V2_ENABLED", "1"),
        )
        self.gang = ProcessGang(
            [self.cmd],
            [base],
            cfg.launch.world_size,
            cfg.launch.timeout_seconds,
            cfg.launch.hang_timeout_seconds,
            startup_timeout=cfg.launch.startup_timeout_seconds,
            heartbeat=os.path.join(self.work_dir, "heartbeat"),
        )

    @property
    def description(self) -> str:
        where = self.address or "a local Ray on 127.0.0.1"
        return f"{self.launch.world_size} Ray Train worker(s) on {where}"

    def collect(self, result: GangResult) -> GangResult:
        result = self.gang.collect(result)
        outcome = _read_result(self.result_path)
        if outcome is None:
            result.launcher_errors = [
                ("RayDriverError", f"the Ray driver ended without a result (exit status {result.returncodes[0]})")
            ]
        else:
            result.failures = [f for f in (from_dict(d) for d in outcome["failures"]) if isinstance(f, Failure)]
            result.lost_ranks = [] if result.reason == "completed" else list(outcome["running"])
            result.launcher_errors = [tuple(e) for e in outcome["launcher_errors"]]
        return result

    def close(self) -> None:
        shutil.rmtree(self.work_dir, ignore_errors=True)


def _read_result(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
