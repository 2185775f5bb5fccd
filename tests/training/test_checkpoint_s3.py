"""Checkpoints to a real S3 endpoint (moto_server on 127.0.0.1, through s3fs), from real
ranks (forked: tests.forked_ranks): manifests land, a fresh process loads them, an outage loses nothing."""

import json
import os
import subprocess
import sys
import time

from stoker.config import load_config
from stoker.contracts import events
from stoker.storage.checkpoints import list_checkpoints, validate_checkpoint
from tests.conftest import ROOT, prepare_shards, tiny_dict
from tests.forked_ranks import start_ranks, train_argv
from tests.netutil import TcpProxy


def _s3_config(root, options, **sections):
    cfg = load_config(tiny_dict(root, **sections))
    return cfg.model_copy(update={"storage": cfg.storage.model_copy(update={"storage_options": options})})


def _start(cfg, store, shard_key, tmp_path, env=None):
    """Two forked ranks (tests.forked_ranks) of the run, its store options (and `env`) in their
    environment."""
    store.write_bytes(f"runs/{cfg.run_name}/config.json", cfg.to_json().encode())
    argv = train_argv(store.url(f"runs/{cfg.run_name}/config.json"), shard_key, cache_dir=str(tmp_path / "cache"))
    options = json.dumps(cfg.storage.storage_options)
    return start_ranks(argv, nproc=2, env={"STOKER_STORAGE_OPTIONS": options, **(env or {})})


def _metric(line):
    if "STOKER_METRIC " not in line:
        return None
    return json.loads(line.split("STOKER_METRIC ", 1)[1])


def test_checkpoints_land_in_s3_with_manifests_and_load_in_a_fresh_process(s3_root, tmp_path):
    root, options = s3_root
    cfg = _s3_config(root, options, run_name="s3run", train={"max_steps": 8}, checkpoint={"interval_steps": 4})
    store, shards = prepare_shards(cfg)
    proc = _start(cfg, store, shards.key, tmp_path)
    try:
        assert proc.wait(timeout=300) == 0, proc.tails()
    finally:
        proc.close()
    refs = list_checkpoints(store, "s3run")
    assert [r.step for r in refs] == [8, 4]
    for ref in refs:
        verdict = validate_checkpoint(store, ref.key, deep=True)
        assert verdict, verdict.reason
        assert {".metadata", "train_state.json", "__0_0.distcp", "__1_0.distcp"} <= set(verdict.manifest["files"])
        assert verdict.manifest["world_size"] == 2 and verdict.manifest["shard_key"] == shards.cache_key
    assert not os.listdir(tmp_path / "cache" / "staging" / "runs" / "s3run" / "checkpoints")  # staging cleared
    # the host kept its own staged copy of the newest committed checkpoint as its verified
    # cache copy (both ranks ran here): a restart on this host loads it without a download
    from stoker.storage.checkpoints import COMMIT_FILE, local_checkpoint_dir, rehydrate

    adopted = local_checkpoint_dir(str(tmp_path / "cache"), store, refs[0].key)
    with open(os.path.join(adopted, COMMIT_FILE)) as f:
        assert json.load(f) == validate_checkpoint(store, refs[0].key).manifest
    before = {n: os.stat(os.path.join(adopted, n)).st_ino for n in os.listdir(adopted)}
    assert rehydrate(store, refs[0].key, str(tmp_path / "cache")) == adopted
    assert {n: os.stat(os.path.join(adopted, n)).st_ino for n in os.listdir(adopted)} == before  # not fetched
    # only the newest host copy is kept
    assert not os.path.exists(local_checkpoint_dir(str(tmp_path / "cache"), store, refs[1].key))

    # a fresh process (no process group) loads the checkpoint from S3 and evaluates it
    ev = subprocess.run(
        [
            sys.executable,
            "-m",
            "stoker.training.evaluation_main",
            "--config",
            store.url("runs/s3run/config.json"),
            "--checkpoint",
            refs[0].key,
            "--shards",
            shards.key,
            "--cache-dir",
            str(tmp_path / "cache2"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "STOKER_STORAGE_OPTIONS": json.dumps(options)},
    )
    assert ev.returncode == 0, ev.stderr[-3000:]
    [result] = [e for e in map(events.decode, ev.stdout.splitlines()) if isinstance(e, events.Evaluated)]
    assert result.step == 8 and result.val_loss > 0


def _behind_a_proxy(s3_server, options):
    """A stoppable TCP proxy in front of the S3 endpoint, and storage options that fail fast
    through it (one attempt, short time-outs: the upload's own retries are under test)."""
    proxy = TcpProxy(s3_server.port)
    proxy.start()
    return proxy, {
        **options,
        "endpoint_url": proxy.url,
        "config_kwargs": {"connect_timeout": 1, "read_timeout": 5, "retries": {"max_attempts": 1}},
    }


def test_s3_outage_during_upload_delays_but_loses_no_checkpoint(s3_server, s3_root, tmp_path):
    root, options = s3_root
    proxy, flaky = _behind_a_proxy(s3_server, options)
    # a backlog of 3: the checkpoints written during this short outage all wait for the store
    cfg = _s3_config(
        root,
        flaky,
        run_name="outage",
        train={"max_steps": 12, "warmup_steps": 2},
        checkpoint={"interval_steps": 4, "keep_latest_k": 10, "max_pending_uploads": 3},
    )
    store, shards = prepare_shards(cfg)
    proc = _start(cfg, store, shards.key, tmp_path)
    events, steps_while_down, down_since = [], [], None
    try:
        for line in proc.lines(timeout=300):
            m = _metric(line)
            if m is None:
                continue
            events.append(m)
            if m["event"] == "step" and m["step"] == 4 and down_since is None:
                proxy.stop()  # the endpoint goes away just as the step-4 checkpoint is saved
                down_since = time.monotonic()
            elif m["event"] == "step" and down_since is not None and proxy._listener is None:
                steps_while_down.append(m["step"])
                if m["step"] == 7:  # training went on without storage; bring it back
                    time.sleep(1.0)
                    proxy.start()
    finally:
        proc.close()
        proxy.stop()
    assert proc.returncode == 0, [e for e in events if e["event"] != "step"][-10:]
    assert steps_while_down[:3] == [5, 6, 7]  # training did not stop during the outage
    assert any(e["event"] == "upload_retry" for e in events)  # the outage hit an upload
    assert not any(e["event"] == "checkpoint_failed" for e in events)
    committed = [e["step"] for e in events if e["event"] == "checkpoint"]
    assert committed == [4, 8, 12]
    proxy.start()
    try:
        refs = list_checkpoints(store, "outage")
        assert [r.step for r in refs] == [12, 8, 4]
        assert all(validate_checkpoint(store, r.key, deep=True) for r in refs)
    finally:
        proxy.stop()


def test_outage_of_many_checkpoint_intervals_keeps_training_and_commits_the_newest(s3_server, s3_root, tmp_path):
    """The store is down from step 2 to step 12 (five checkpoint intervals): the ranks keep
    stepping and writing checkpoints to staging, at most 2 wait for the store, the oldest
    waiting ones are dropped (the same on both ranks, reported; never the upload under way), and
    once the store is back the newest is committed, the commits in order. Nothing fails."""
    root, options = s3_root
    proxy, flaky = _behind_a_proxy(s3_server, options)
    # a save that waited for an upload would wait for it to give up: a checkpoint_failed record
    cfg = _s3_config(
        root,
        flaky,
        run_name="longoutage",
        train={"max_steps": 24, "warmup_steps": 2},
        eval={"interval_steps": 100},
        checkpoint={
            "interval_steps": 2,
            "keep_latest_k": 20,
            "max_pending_uploads": 2,
            "upload_timeout_seconds": 60,
            "commit_timeout_seconds": 60,
        },
    )
    store, shards = prepare_shards(cfg)
    proc = _start(cfg, store, shards.key, tmp_path)
    records, steps_while_down, staged_while_down = [], [], []
    try:
        for line in proc.lines(timeout=300):
            m = _metric(line)
            if m is None:
                continue
            records.append(m)
            down = proxy._listener is None
            if m["event"] == "step" and m["step"] == 2 and not down:
                proxy.stop()
            elif m["event"] == "step" and down:
                steps_while_down.append(m["step"])
                if m["step"] == 12:
                    proxy.start()
            elif m["event"] == "checkpoint_staged" and down:
                staged_while_down.append(m["step"])
    finally:
        proc.close()
        proxy.stop()
    assert proc.returncode == 0, [e for e in records if e["event"] != "step"][-10:]
    assert steps_while_down == list(range(3, 13))  # training went on without its store
    assert {4, 6, 8} <= set(staged_while_down)  # and so did checkpointing, to local staging
    assert not [e for e in records if e["event"] in ("checkpoint_failed", "failure")]
    committed = [e["step"] for e in records if e["event"] == "checkpoint"]
    dropped = {r: {e["step"] for e in records if e["event"] == "checkpoint_dropped" and e["rank"] == r} for r in (0, 1)}
    # the newest, in order. Which came before it depends on the upload under way when the
    # store came back: it is never dropped (the uploader's livelock fix), so a slow one (its
    # retry's backoff) can see 20 and 22 dropped while 24 waits behind it
    assert committed == sorted(committed) and committed[-1] == 24
    assert dropped[0] and dropped[1] <= dropped[0]  # rank 0 decides; no rank drops another one
    assert set(committed) | dropped[0] == set(range(2, 25, 2)) and not set(committed) & dropped[0]
    [done] = [e for e in records if e["event"] == "done"]
    assert {int(f.split(":")[0].split()[1]) for f in done["failed_checkpoints"]} == dropped[0]
    proxy.start()
    try:
        refs = {r.step: r for r in list_checkpoints(store, "longoutage")}
        assert all(validate_checkpoint(store, refs[s].key, deep=True) for s in committed)
        assert not any(validate_checkpoint(store, refs[s].key) for s in dropped[0] if s in refs)
    finally:
        proxy.stop()
    staging = tmp_path / "cache" / "staging"
    assert not [f for _, _, files in os.walk(staging) for f in files]  # dropped staging deleted


def test_a_deleted_bucket_fails_the_checkpoint_stream_once_and_training_reaches_max_steps(s3_root, tmp_path):
    """The bucket is deleted under a running job (once the ranks have read their inputs from
    it): each rank says the first permanent error it meets with the store's reason, once; no
    upload is retried; the checkpoints written by then are committed, dropped for a newer one
    or failed, none committed after the first failure; every later checkpoint fails at once
    without being written; and training reaches max_steps. Which checkpoint meets the missing
    bucket first, on which rank, depends on how fast the uploads go: 12 checkpoint intervals
    leave room for later ones on a loaded machine (with 6, all six were once staged before the
    first upload had failed). Each step sleeps first (STOKER_FAULT=slow): an interval lasts
    over a second of mostly idle time in which the uploads run (they once waited for the GIL
    behind 32 busy steps), for a fraction of the CPU of busy steps."""
    root, options = s3_root
    interval, max_steps = 8, 96
    cfg = _s3_config(
        root,
        options,
        run_name="nobucket",
        train={"max_steps": max_steps, "warmup_steps": 2},
        eval={"interval_steps": 100},
        checkpoint={"interval_steps": interval, "upload_timeout_seconds": 120, "commit_timeout_seconds": 120},
    )
    store, shards = prepare_shards(cfg)
    proc = _start(cfg, store, shards.key, tmp_path, env={"STOKER_FAULT": "slow:seconds=0.15"})
    records = []
    try:
        for line in proc.lines(timeout=300):
            m = _metric(line)
            if m is not None:
                records.append(m)
                if m["event"] == "train" and m["step"] == 1:  # inputs read, no checkpoint yet
                    _delete_bucket(options["endpoint_url"], root.split("/")[2])
    finally:
        proc.close()
    assert proc.returncode == 0, [e for e in records if e["event"] != "step"][-10:]
    [done] = [e for e in records if e["event"] == "done"]
    assert done["step"] == max_steps and done["failed_checkpoints"]
    failed = [e for e in records if e["event"] == "checkpoint_failed"]
    committed = [e["step"] for e in records if e["event"] == "checkpoint"]
    dropped = [e for e in records if e["event"] == "checkpoint_dropped"]
    staged = [e["step"] for e in records if e["event"] == "checkpoint_staged"]
    assert all("NoSuchBucket" in e["error"] for e in failed), [(e["step"], e["error"]) for e in failed]
    first = min(e["step"] for e in failed)  # the first checkpoint that met the missing bucket
    assert max(committed, default=0) < first
    assert all("max_pending_uploads" in e["reason"] for e in dropped), dropped
    settled = set(committed) | {e["step"] for e in dropped} | {e["step"] for e in failed}
    assert all(s in settled for s in staged), (staged, settled)
    unwritten = [s for s in range(interval, max_steps + 1, interval) if s not in staged]  # from some step on, none is
    assert unwritten and unwritten == list(range(unwritten[0], max_steps + 1, interval)), staged
    for step in unwritten:  # failed at once, said once, by rank 0
        [e] = [e for e in failed if e["step"] == step]
        assert e["error"].startswith("not attempted") and e["rank"] == 0, e
    said = [e for e in failed if "no later checkpoint is attempted" in e["error"]]
    assert said and len({e["rank"] for e in said}) == len(said), said  # once a rank
    assert not [e for e in records if e["event"] == "upload_retry"]


def _delete_bucket(endpoint_url, bucket):
    """Empty the bucket and delete it (again while a rank still adds an object to it)."""
    import boto3

    client = boto3.client("s3", endpoint_url=endpoint_url)
    for _ in range(20):
        listing = client.list_objects_v2(Bucket=bucket)
        gone = [{"Key": o["Key"]} for o in listing.get("Contents", [])]
        if gone:
            client.delete_objects(Bucket=bucket, Delete={"Objects": gone})
            continue
        try:
            client.delete_bucket(Bucket=bucket)
            return
        except client.exceptions.ClientError:  # BucketNotEmpty: an object came in meanwhile
            pass
    raise AssertionError(f"could not delete bucket {bucket}")
