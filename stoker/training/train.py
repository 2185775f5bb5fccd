"""Entry point of every rank: ``torchrun ... -m stoker.training.train --config <run>/config.json``.

Parse, build, train, close. No orchestrator is imported here or below. A failure of any
kind (``BaseException`` included) is filed through torchelastic's ``@record`` error file with
stoker's verdict on it (``extraInfo.stoker``, a ``contracts.events.Failure``), which the launcher
reads after the gang ends, and is printed as a Failure event for the live log.

In-place recovery: torchrun restarts the ranks (``launch.max_restarts``) after one dies.
A restarted rank ignores ``--resume-from`` (chosen before the failure) and resumes from the
newest valid checkpoint of its run, which rank 0 picks from the store and tells the others.
A rank that failed permanently leaves its Failure in the launch's marker file before it
prints it; on that line the launcher ends the gang before torchrun restarts it (launch.gang).
Restarted ranks that find the marker anyway end at once with the same failure.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
import traceback
from functools import partial

import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from stoker.config import RunConfig
from stoker.contracts import events
from stoker.contracts.results import parse_shards_arg
from stoker.failures import RankAborted, is_transient
from stoker.process import lifeline
from stoker.process.quick_exit import quick_exit
from stoker.storage.branches import branch_point
from stoker.storage.checkpoints import find_latest_valid
from stoker.storage.runs import read_config
from stoker.storage.shards import materialize, shard_set_name
from stoker.storage.store import Store, default_cache_dir
from stoker.training.distributed import setup_distributed, stop_already_asked, stop_grace_seconds
from stoker.training.loop import Trainer
from stoker.training.metrics import emit

GANG_ENV = "STOKER_GANG_ID"  # launch.gang.GANG_ENV (training never imports launch)


def failure_of(e: BaseException) -> events.Failure:
    """This rank's Failure record of an exception: its type, message and whether a retry helps."""
    cause = e.__cause__ if isinstance(e, RankAborted) and e.__cause__ is not None else e
    return events.Failure(
        rank=int(os.environ.get("RANK", "0")),
        type=type(cause).__name__,
        message=str(cause)[:800],
        transient=is_transient(e),
    )


class RankErrorHandler(ErrorHandler):
    """torchelastic's structured error file, plus the Failure record the launcher classifies by."""

    def record_exception(self, e: BaseException) -> None:
        failure = failure_of(e)
        try:
            self._write(failure)
        finally:  # said last: the launcher ends the gang on a permanent one, files already written
            emit(failure)

    def _write(self, failure: events.Failure) -> None:
        path = self._get_error_file_path()
        if not path:
            return
        data = {
            "message": {
                "message": f"{failure.type}: {failure.message}",
                "extraInfo": {
                    "py_callstack": traceback.format_exc(),
                    "timestamp": str(int(time.time())),
                    events.ERROR_INFO_KEY: failure.to_dict(),
                },
            }
        }
        with open(path, "w") as f:
            json.dump(data, f)
        marker = os.environ.get(events.PERMANENT_MARKER_ENV)
        if marker and not failure.transient:
            with open(marker, "w") as f:
                json.dump(failure.to_dict(), f)


class FailedBefore(Exception):
    """A rank of this launch failed permanently before torchrun restarted the ranks."""


def before_message(failure: events.Failure) -> str:
    """Why a restarted rank ends at once: the first failure, said once (a FailedBefore read
    back from the marker is not wrapped again)."""
    if failure.type == "FailedBefore":
        return failure.message
    return f"not restarted: rank {failure.rank} failed with {failure.type}: {failure.message}"


def _end_if_failed_for_good() -> None:
    marker = os.environ.get(events.PERMANENT_MARKER_ENV)
    if marker and os.path.exists(marker):
        with open(marker) as f:
            failure = events.from_dict(json.load(f))
        raise FailedBefore(before_message(failure))


def newest_checkpoint(store: Store, cfg: RunConfig) -> str | None:
    """The newest valid checkpoint of this run and model, picked by rank 0 and told to every
    rank (a restarted gang resumes from what was committed before the failure)."""
    box = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        run = cfg.resolved_run_name()
        choice = find_latest_valid(store, run, {"run_name": run, "model_hash": cfg.model_hash()}, cfg.train)
        box[0] = choice.checkpoint.key if choice.checkpoint else None
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)  # group: world
    return box[0]


def any_rank_restarted(mine: bool) -> bool:
    """Whether this gang is a restart round. torchrun counts a restart on the nodes whose ranks
    failed; a node that restarts its ranks only because another node came back to the
    rendezvous keeps TORCHELASTIC_RESTART_COUNT at 0, so with several nodes the ranks ask
    each other."""
    if not dist.is_initialized():
        return mine
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, mine)  # group: world; one agreed answer for every rank
    return any(flags)


def run_rank(config_url: str, shards: str, resume_from: str | None, cache_dir: str, restarted: bool) -> dict:
    """One rank's whole run, under any launcher: join the process group (torchrun's or Ray's),
    load the shards once per host, resume (a restart round from the newest valid checkpoint,
    else from `resume_from`), train."""
    cfg = read_config(config_url)
    ranks = setup_distributed(cfg)
    restarted = any_rank_restarted(restarted)
    store = Store.of(cfg.storage)
    resume = newest_checkpoint(store, cfg) if restarted else resume_from
    point = branch_point(cfg)
    if not resume and point is not None:  # a branch with no checkpoint of its own: its branch point
        resume = point[0]
    # resume owns the weights once any checkpoint is committed; with none (a restart before
    # the first one included), a run with a base starts from the base, never from random weights
    from_base = not resume and bool(cfg.model.init_from)
    named = [(name, shard_set_name(key)) for name, key in parse_shards_arg(shards)]
    shard_dirs = {name: materialize(store, cache_key, cache_dir) for name, cache_key in named}
    # the checkpoints name the data: the shard set's cache key, or name=cache key per source
    shard_key = named[0][1] if "=" not in shards else ",".join(f"{n}={k}" for n, k in named)
    trainer = Trainer(cfg, ranks, shard_dirs, store, shard_key, cache_dir=cache_dir, from_base=from_base)
    if resume:
        trainer.resume(resume)
    elif from_base:
        trainer.start_from_base()
    return trainer.fit()


def file_rank_numbers() -> None:
    """Say this rank's global, group and local rank: on stdout (a Joined event, from which the
    launcher prefixes this rank's lines) and beside its torchelastic error file (where the
    launcher looks for its fate). c10d numbers the nodes in its own order, so the launcher
    cannot work a global rank out from the order it started the nodes in."""
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not error_file or "RANK" not in os.environ:  # not a torchrun rank
        return
    numbers = {
        name.lower(): int(os.environ[name])
        for name in ("RANK", "GROUP_RANK", "LOCAL_RANK")
        if os.environ.get(name, "").isdigit()
    }
    if len(numbers) == 3:
        print(events.Joined(**numbers).encode(), flush=True)
    try:
        with open(os.path.join(os.path.dirname(error_file), events.RANK_FILE), "w") as f:
            json.dump(numbers, f)
    except OSError:  # evidence only: the launcher falls back to the launch order
        pass


def watch_launcher() -> None:
    """Stop this rank the way a cancel does (SIGTERM: a stop checkpoint when it fits) when the
    process that launched the gang is gone, or this rank's torchrun agent is: a launcher
    SIGKILLed by the OOM killer, or a lost VM, never stops the gang itself. Local rank 0 also
    sends its agent SIGTERM, so the agent neither restarts the ranks nor waits on."""
    is_torchrun_rank = "TORCHELASTIC_RESTART_COUNT" in os.environ
    watch = lifeline.Lifeline.from_env(_launcher_gone, watch_parent=is_torchrun_rank)
    if watch is not None and os.environ.get(GANG_ENV):  # only ranks a stoker launcher started
        watch.start()


def _launcher_gone(reason: str) -> None:
    agent = os.getppid()
    if os.environ.get("LOCAL_RANK") == "0" and agent > 1 and _same_gang(agent):
        try:
            os.kill(agent, signal.SIGTERM)
        except ProcessLookupError:
            pass
    lifeline.terminate_self(stop_grace_seconds() + 15.0, announce=lambda: not stop_already_asked())(reason)


def _same_gang(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{GANG_ENV}={os.environ[GANG_ENV]}".encode() in f.read().split(b"\0")
    except OSError:
        return False


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Train one rank of a stoker run.")
    p.add_argument("--config", required=True, help="URL or path of the run's config.json")
    p.add_argument(
        "--shards",
        required=True,
        help="shard-set key under the store root (shards/<key>), or name=key,... per source of a mixture",
    )
    p.add_argument("--resume-from", default=None, help="checkpoint key under the store root")
    p.add_argument("--cache-dir", default=default_cache_dir())
    return p.parse_args(argv)


@partial(record, error_handler=RankErrorHandler())
def main(argv: list[str] | None = None) -> None:
    file_rank_numbers()
    watch_launcher()
    args = parse_args(argv)
    try:
        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
        if restarted:
            _end_if_failed_for_good()
        run_rank(args.config, args.shards, args.resume_from, args.cache_dir, restarted)
    except (Exception, SystemExit, KeyboardInterrupt):
        raise
    except BaseException as exc:  # e.g. DCP's CheckpointException, which @record would not see
        raise RankAborted(f"{type(exc).__name__}: {exc}") from exc
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
    quick_exit(0)  # a failure raised above takes Python's own exit (the error file is written)
