"""Failure to first resumed step, against a real S3 endpoint (moto_server on 127.0.0.1).

A rank is SIGKILLed mid-run, twice:
1. Relaunch (launch.max_restarts=0): the time until the first step of the resumed gang is
   split into detection (failure -> gang reaped), validation (listing + manifests + sizes),
   rehydration (verified download of the chosen checkpoint into an empty host cache, as on
   another host; the relaunched gang on this host finds its own staged copy instead) and
   process start (new gang -> ranks resumed -> first step).
   Goal: rehydration time / a plain copy (fs.get) of the same bytes <= 1.5.
2. In place (launch.max_restarts=1): torchrun restarts the ranks, which find and load the
   newest valid checkpoint themselves. Goal: failure -> first resumed step <= 8 s.

    python -m benchmarks.bench_resume [--smoke] [--endpoint URL]

--smoke: a 300 KB corpus, a 2-layer model of width 32, one rank, 4 steps, the kill at step 3
(after the checkpoint of step 2); it checks that the benchmark runs, its figures mean nothing.
--endpoint: an S3 endpoint already running (a fresh bucket is made on it) instead of a
moto_server of its own.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

from benchmarks._servers import moto_s3, s3_bucket
from stoker.config import load_config
from stoker.contracts import events
from stoker.data import prepare as data_prep
from stoker.launch.env import child_env
from stoker.launch.gang import run_gang
from stoker.launch.torchrun import free_port, torchrun_commands
from stoker.storage.checkpoints import list_checkpoints, rehydrate, validate_checkpoint
from stoker.storage.store import Store, join

# --smoke: what it changes in the config; the fault (the full run's and the smoke run's)
SMOKE = {
    "data": {"max_bytes": 300_000},
    "tokenizer": {"vocab_size": 384},
    "model": {"n_layer": 2, "n_head": 2, "n_embd": 32, "block_size": 32},
    "train": {"max_steps": 4},
    "checkpoint": {"interval_steps": 2},
    "launch": {"nproc_per_node": 1},
}
KILL = "kill:rank=1:step=11"
SMOKE_KILL = "kill:rank=0:step=3"  # the one rank


def _config(root: str, options: dict, smoke: bool = False):
    sections = {
        "run_name": "bench-resume",
        "storage": {"root": root, "storage_options": options},
        "data": {"max_bytes": 1_000_000},
        "tokenizer": {"vocab_size": 2048},
        "model": {"n_layer": 6, "n_head": 8, "n_embd": 384, "block_size": 64},
        "train": {
            "max_steps": 12,
            "warmup_steps": 2,
            "log_interval": 1,
            "global_batch_size": 8,
            "micro_batch_size": 4,
        },
        "checkpoint": {"interval_steps": 4},
        "eval": {"interval_steps": 100, "num_batches": 1, "per_checkpoint_enabled": False},
    }
    for section, values in (SMOKE if smoke else {}).items():
        sections[section] = {**sections.get(section, {}), **values}
    cfg = load_config(sections)
    return cfg


def _time_load(make_reader) -> float:
    """Seconds for dcp.load of every tensor of a checkpoint through the given reader."""
    meta = make_reader().read_metadata().state_dict_metadata
    state = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.items()}
    t0 = time.perf_counter()
    dcp.load(state, storage_reader=make_reader(), no_dist=True)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="a tiny run, killed once: checks the benchmark runs")
    p.add_argument("--endpoint", help="an S3 endpoint already running (default: a moto_server of its own)")
    args = p.parse_args(argv)
    kill = SMOKE_KILL if args.smoke else KILL
    s3 = s3_bucket(args.endpoint) if args.endpoint else moto_s3()
    with s3 as (root, options), tempfile.TemporaryDirectory() as tmp:
        os.environ["STOKER_CACHE"] = os.path.join(tmp, "cache")
        cfg = _config(root, options, args.smoke)
        store = Store(root, options)
        ds = data_prep.download_dataset(cfg.data, store)
        tok = data_prep.train_tokenizer(ds, cfg.tokenizer, store)
        shards = data_prep.tokenize_and_shard(ds, tok, cfg.data, store)
        store.write_bytes("runs/bench-resume/config.json", cfg.to_json().encode())
        config_url = store.url("runs/bench-resume/config.json")
        once = os.path.join(tmp, "fault-fired")
        env = {**child_env(cfg), "STOKER_FAULT": kill, "STOKER_FAULT_ONCE": once}

        relaunch = cfg.model_copy(update={"launch": cfg.launch.model_copy(update={"max_restarts": 0})})
        first = run_gang(
            torchrun_commands(relaunch, config_url, shards.key, None, free_port()),
            env,
            cfg.launch.nproc_per_node,
            lambda s: None,
            lambda m: None,
            timeout=600,
        )
        reaped = time.time()
        assert first.reason == "failed", first.tail[-20:]
        detection = reaped - os.path.getmtime(once)

        t0 = time.perf_counter()
        refs = list_checkpoints(store, "bench-resume")
        chosen = next(r for r in refs if validate_checkpoint(store, r.key, deep=False))
        validation = time.perf_counter() - t0
        t0 = time.perf_counter()
        # measured as on another host: this one kept its own staged copy as its cache copy
        local = rehydrate(store, chosen.key, os.path.join(tmp, "another-host-cache"))
        rehydration = time.perf_counter() - t0
        names = sorted(os.listdir(local))
        nbytes = sum(os.path.getsize(os.path.join(local, n)) for n in names if n != "commit.json")
        plain_dir = os.path.join(tmp, "plain")
        os.makedirs(plain_dir)
        t0 = time.perf_counter()
        for n in names:
            if n != "commit.json":
                store.fs.get_file(store._path(join(chosen.key, n)), os.path.join(plain_dir, n))
        plain = time.perf_counter() - t0

        # the measured choice: load straight from the object store vs rehydrate + local load
        remote = _time_load(lambda: FsspecReader(store.url(chosen.key), **options))
        local_load = _time_load(lambda: dcp.FileSystemReader(local))
        print(
            f"  load the checkpoint straight from S3: {remote:.2f}s; rehydrate + local load: "
            f"{rehydration + local_load:.2f}s (rehydration verifies every byte on the way)"
        )

        marks: dict[str, float] = {}

        def on_event(e: events.Event) -> None:
            if isinstance(e, events.Resumed):
                marks.setdefault("resumed", time.perf_counter())
            elif isinstance(e, events.Train) and e.step == chosen.step + 1:
                marks.setdefault("first_step", time.perf_counter())

        t_launch = time.perf_counter()
        second = run_gang(
            torchrun_commands(relaunch, config_url, shards.key, chosen.key, free_port()),
            env,
            cfg.launch.nproc_per_node,
            lambda s: None,
            on_event,
            timeout=600,
        )
        assert second.reason == "completed", second.tail[-20:]
        start = marks["resumed"] - t_launch
        first_step = marks["first_step"] - marks["resumed"]
        total = detection + validation + rehydration + start + first_step
        print(f"  checkpoint of step {chosen.step}: {nbytes / 1e6:.1f} MB in {len(names) - 1} files")
        print(
            f"  failure -> first resumed step: {total:.2f}s = detection {detection:.2f}s + validation "
            f"{validation:.2f}s + rehydration {rehydration:.2f}s + process start and load {start:.2f}s "
            f"+ first step {first_step:.2f}s"
        )
        ratio = rehydration / plain
        print(f"  plain copy of the same bytes: {plain:.2f}s")
        print(f"  RATIO rehydration / plain copy = {ratio:.2f}  (goal <= 1.5: {'met' if ratio <= 1.5 else 'NOT met'})")
        shutil.rmtree(plain_dir, ignore_errors=True)
        relaunch_total = total

        # 2. in place: the same kill, with torchrun restarting the ranks
        inplace = cfg.model_copy(
            update={"run_name": "bench-resume-inplace", "launch": cfg.launch.model_copy(update={"max_restarts": 1})}
        )
        store.write_bytes("runs/bench-resume-inplace/config.json", inplace.to_json().encode())
        once2 = os.path.join(tmp, "fault-fired-inplace")
        env2 = {**env, "STOKER_FAULT_ONCE": once2}
        marks2: dict[str, float] = {}

        def on_event2(e: events.Event) -> None:
            if isinstance(e, events.Resumed):
                marks2.setdefault("resumed", time.time())
                marks2.setdefault("resumed_step", e.step)
            elif isinstance(e, events.Train) and "resumed" in marks2 and e.step == marks2["resumed_step"] + 1:
                marks2.setdefault("first_step", time.time())

        third = run_gang(
            torchrun_commands(
                inplace, store.url("runs/bench-resume-inplace/config.json"), shards.key, None, free_port()
            ),
            env2,
            cfg.launch.nproc_per_node,
            lambda s: None,
            on_event2,
            timeout=600,
        )
        assert third.reason == "completed", third.tail[-20:]
        fault_at = os.path.getmtime(once2)
        restart = marks2["resumed"] - fault_at
        step = marks2["first_step"] - marks2["resumed"]
        total2 = restart + step
        print(
            f"  in place (torchrun --max-restarts): failure -> first resumed step: {total2:.2f}s = "
            f"restart, process start, rendezvous, choice and load {restart:.2f}s + first step {step:.2f}s"
        )
        print(
            f"  relaunch {relaunch_total:.2f}s -> in place {total2:.2f}s  (goal <= 8 s: "
            f"{'met' if total2 <= 8 else 'NOT met'})"
        )


if __name__ == "__main__":
    main()
