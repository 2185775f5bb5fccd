"""Launchers behind one small interface (launch.base.Launcher): the torchrun gang and Ray."""

from __future__ import annotations

from stoker.config import RunConfig
from stoker.launch.base import Launcher


def make_launcher(cfg: RunConfig, config_url: str, shard_key: str, resume_key: str | None) -> Launcher:
    """The launcher `launch.launcher` names, for one launch attempt."""
    if cfg.launch.launcher == "local":
        from stoker.launch.torchrun import TorchrunLauncher

        return TorchrunLauncher(cfg, config_url, shard_key, resume_key)
    if cfg.launch.launcher == "ray":
        from stoker.launch.ray import RayLauncher

        return RayLauncher(cfg, config_url, shard_key, resume_key)
    raise ValueError(f"launch.launcher: unknown launcher {cfg.launch.launcher!r}")  # the config forbids it
