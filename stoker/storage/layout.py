"""The run-folder layout under a store root, and parsing URLs back into it. The one place
that knows where a run's files live:

    {root}/runs/{run}/config.json, tokenizer.json, shards.json
    {root}/runs/{run}/base/config.json, tokenizer_config.json ... (a run started from a base)
    {root}/runs/{run}/checkpoints/step-00001200/
    {root}/runs/{run}/metrics.jsonl, attempts.jsonl
    {root}/runs/{run}/lease.json (while a launch trains the run)
    {root}/runs/{run}/tensorboard/events.out.tfevents.*
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from stoker.failures import ConfigError
from stoker.storage.store import join

RUNS = "runs"
CONFIG_FILE = "config.json"
SHARDS_FILE = "shards.json"
TOKENIZER_FILE = "tokenizer.json"
BASE_DIR = "base"  # a base model's config.json and tokenizer configs, pinned with the run (model.init_from)
METRICS_FILE = "metrics.jsonl"
ATTEMPTS_FILE = "attempts.jsonl"
LEASE_FILE = "lease.json"  # the run lease: which launch trains the run (stoker/storage/lease.py)
TENSORBOARD_DIR = "tensorboard"  # event files of the metric sink (metrics.tensorboard_enabled)
_CHECKPOINT_URL = re.compile(r"^(?P<root>.+)/runs/(?P<run>[^/]+)/checkpoints/(?P<name>[^/]+)/?$")


def run_key(run_name: str) -> str:
    return join(RUNS, run_name)


def run_file_key(run_name: str, name: str) -> str:
    """A file of the run folder: CONFIG_FILE, SHARDS_FILE, METRICS_FILE, ATTEMPTS_FILE ..."""
    return join(RUNS, run_name, name)


def checkpoints_key(run_name: str) -> str:
    return join(RUNS, run_name, "checkpoints")


@dataclass(frozen=True)
class CheckpointLocation:
    """A checkpoint URL taken apart: its store root, run and key under the root."""

    root: str
    run_name: str
    key: str


def parse_checkpoint_url(url: str) -> CheckpointLocation:
    """``{root}/runs/{run}/checkpoints/{name}`` -> its parts; ValueError naming the form."""
    m = _CHECKPOINT_URL.match(url.strip())
    if not m:
        raise ConfigError(
            [
                f"checkpoint_uri: {url!r} is not of the form "
                "{root}/runs/{run}/checkpoints/step-NNNNNNNN; copy it from the run "
                "report or the flow log"
            ]
        )
    run, name = m.group("run"), m.group("name")
    return CheckpointLocation(m.group("root"), run, join(checkpoints_key(run), name))
