"""The checkpoint uploader against a real S3 endpoint (moto_server on 127.0.0.1), with a
stoppable proxy for outages: writes never wait for uploads, the backlog is bounded (the
oldest waiting checkpoint not yet uploading is dropped and reported), a permanently broken store is not
retried. One rank, no torch: `write` puts small files into the staging folder."""

import os
import time

import pytest
import torch

from stoker.contracts import events
from stoker.storage.checkpoints import COMMIT_FILE, list_checkpoints, validate_checkpoint
from stoker.storage.store import Store, join
from stoker.storage.uploader import CheckpointUploader
from stoker.training.checkpoint import Checkpointer
from tests.netutil import TcpProxy

# fail fast while the proxy refuses connections (botocore's own retries off)
QUICK = {"config_kwargs": {"connect_timeout": 1, "read_timeout": 5, "retries": {"max_attempts": 1}}}


def _write(step):
    def write(key, folder):
        os.makedirs(folder, exist_ok=True)
        for name in (".metadata", "__0_0.distcp"):
            with open(os.path.join(folder, name), "wb") as f:
                f.write(f"{name} of step {step}".encode() * 100)
        return [".metadata", "__0_0.distcp"]

    return write


def _uploader(store, tmp_path, seen, **kw):
    args = dict(
        rank=0,
        world_size=1,
        staging_root=str(tmp_path / "staging"),
        keep_latest_k=10,
        upload_timeout=120,
        commit_timeout=120,
        async_enabled=True,
        on_event=seen.append,
    )
    return CheckpointUploader(store, "r", **{**args, **kw})


def _kinds(seen, cls):
    return [e.step for e in seen if isinstance(e, cls)]


@pytest.fixture
def proxied(s3_server, s3_root):
    """(store through a proxy the test can stop, the proxy); the bucket is real."""
    root, options = s3_root
    proxy = TcpProxy(s3_server.port)
    proxy.start()
    yield Store(root, {**options, **QUICK, "endpoint_url": proxy.url}), proxy
    proxy.stop()


def test_outage_keeps_the_newest_checkpoints_and_drops_the_oldest_with_a_record(proxied, tmp_path):
    store, proxy = proxied
    seen = []
    uploader = _uploader(store, tmp_path, seen, max_pending_uploads=2)
    proxy.stop()  # the store goes away before the first upload
    for step in (1, 2, 3, 4, 5):
        uploader.submit(step, {}, _write(step))
        uploader.wait_written()  # what Checkpointer.save waits for: never an upload
        deadline = time.monotonic() + 30
        while step == 1 and uploader.uploading is None and time.monotonic() < deadline:
            time.sleep(0.01)  # step 1's upload is under way (and fails while the store is down)
    # every checkpoint was written while the store was down; 2 wait for it: the one whose
    # upload is under way (step 1, never dropped: else a store slower than the checkpoints
    # would never commit any) and the newest
    assert _kinds(seen, events.CheckpointStaged) == [1, 2, 3, 4, 5]
    assert uploader.pending_steps() == [1, 5]
    assert _kinds(seen, events.CheckpointCommitted) == []
    proxy.start()
    assert uploader.wait(timeout=120)
    # the ones between were dropped; the upload under way and the newest committed in order
    assert sorted(_kinds(seen, events.CheckpointDropped)) == [2, 3, 4]
    assert _kinds(seen, events.CheckpointCommitted) == [1, 5]
    assert not _kinds(seen, events.CheckpointFailed)
    dropped = [e for e in seen if isinstance(e, events.CheckpointDropped)]
    assert all("max_pending_uploads" in e.reason for e in dropped)
    assert sorted(f.split(":")[0] for f in uploader.failures) == ["step 2", "step 3", "step 4"]
    committed = {r.step: r for r in list_checkpoints(store, "r")}
    assert all(validate_checkpoint(store, committed[s].key, deep=True) for s in (1, 5))
    for s in (2, 3, 4):  # a dropped checkpoint is never committed
        assert s not in committed or not store.exists(join(committed[s].key, COMMIT_FILE))
    staging = tmp_path / "staging"
    assert not [f for _, _, files in os.walk(staging) for f in files]  # nothing left on local disk


def test_a_missing_bucket_fails_the_checkpoint_stream_once_without_retries(s3_server, tmp_path):
    store = Store(
        "s3://stoker-no-such-bucket/root", {"endpoint_url": s3_server.url, "skip_instance_cache": True, **QUICK}
    )
    seen = []
    # a retried upload would take up to upload_timeout: the waits below would time out
    uploader = _uploader(store, tmp_path, seen, upload_timeout=600, commit_timeout=600)
    uploader.submit(1, {}, _write(1))
    assert uploader.wait(timeout=60)
    for step in (2, 3):
        uploader.submit(step, {}, _write(step))
    assert uploader.wait(timeout=60)
    failed = [e for e in seen if isinstance(e, events.CheckpointFailed)]
    assert [e.step for e in failed] == [1, 2, 3]
    assert "NoSuchBucket" in failed[0].error and "no later checkpoint is attempted" in failed[0].error
    assert all(e.error.startswith("not attempted") and "NoSuchBucket" in e.error for e in failed[1:])
    assert not _kinds(seen, events.UploadRetry)  # a permanent error is never retried
    assert _kinds(seen, events.CheckpointStaged) == [1]  # later ones are not even written
    assert "NoSuchBucket" in uploader.broken
    assert not [f for _, _, files in os.walk(tmp_path / "staging") for f in files]


def test_checkpointer_save_returns_while_the_store_is_down(proxied, tmp_path):
    """The training thread's save waits for the previous write only: with the store down,
    saves go on (nothing was uploaded, nothing failed), and the state of each step lands."""
    from tests.training.test_checkpoint import _build, _train

    store, proxy = proxied
    seen = []
    # a save that waited for the previous upload would wait for this upload to give up,
    # reported as checkpoint_failed
    uploader = _uploader(store, tmp_path, seen, upload_timeout=30, commit_timeout=30, max_pending_uploads=3)
    model, opt, sched = _build()
    ckpt = Checkpointer(
        uploader, model, opt, sched, rank=0, world_size=1, device=torch.device("cpu"), seed=0, global_batch_size=2
    )
    proxy.stop()
    for step in (1, 2, 3):
        _train(model, opt, sched, 1)
        ckpt.save(step, step * 16, {})
    at_last_save = {n: p.detach().clone() for n, p in model.named_parameters()}
    uploader.wait_written()
    assert uploader.pending_steps() == [1, 2, 3]  # saved, none uploaded yet
    assert not _kinds(seen, events.CheckpointFailed) and not _kinds(seen, events.CheckpointCommitted)
    proxy.start()
    assert uploader.wait(timeout=120)
    assert _kinds(seen, events.CheckpointCommitted) == [1, 2, 3]
    from stoker.storage.checkpoints import rehydrate
    from stoker.training.checkpoint import load_checkpoint

    fresh, fopt, fsched = _build(seed=7)
    key = [e.key for e in seen if isinstance(e, events.CheckpointCommitted)][-1]
    state = load_checkpoint(
        rehydrate(store, key, str(tmp_path / "cache")), model=fresh, optimizer=fopt, scheduler=fsched
    )
    assert state.step == 3
    for n, p in fresh.named_parameters():
        assert torch.equal(p, at_last_save[n]), n


def test_rank0_pins_each_checkpoint_for_its_evaluation_before_the_commit(s3_root, tmp_path):
    """With per-checkpoint evaluation, retention (keep_latest_k=2) deletes no checkpoint whose
    evaluation has not run; each goes once its evaluation is done."""
    from stoker.storage.checkpoints import EVAL_PIN, finish_evaluation

    root, options = s3_root
    store = Store(root, options)
    uploader = _uploader(store, tmp_path, [], keep_latest_k=2, async_enabled=False, pin_evaluations=True)
    for step in (1, 2, 3, 4):
        uploader.submit(step, {}, _write(step))
    refs = list_checkpoints(store, "r")
    assert [r.step for r in refs] == [4, 3, 2, 1]  # nothing evaluated yet: nothing deleted
    assert all(store.exists(join(r.key, EVAL_PIN)) and validate_checkpoint(store, r.key) for r in refs)
    assert EVAL_PIN not in store.read_json(join(refs[0].key, COMMIT_FILE))["files"]
    assert finish_evaluation(store, "r", refs[3].key, keep_latest_k=2) == [refs[3].key]
    assert finish_evaluation(store, "r", refs[0].key, keep_latest_k=2) == []  # the newest stays
    assert [r.step for r in list_checkpoints(store, "r")] == [4, 3, 2]
