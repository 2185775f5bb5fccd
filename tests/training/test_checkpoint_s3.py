"""Checkpoints to a real S3 endpoint (moto_server on 127.0.0.1, through s3fs), from real
torchrun ranks: manifests land, a fresh process loads them, an outage loses nothing."""

import json
import os
import subprocess
import sys
import time

import pytest

from core import events
from storage.checkpoints import list_checkpoints, validate_checkpoint
from launch.torchrun import free_port
from tests.conftest import ROOT, prepare_shards, tiny_dict
from tests.netutil import TcpProxy
from core.config import load_config


def _s3_config(root, options, **sections):
    cfg = load_config(tiny_dict(root, **sections))
    return cfg.model_copy(update={"storage": cfg.storage.model_copy(update={"storage_options": options})})


def _start(cfg, store, shard_key, tmp_path):
    store.write_bytes(f"runs/{cfg.run_name}/config.json", cfg.to_json().encode())
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--tee=3",
           "-m", "training.train", "--config", store.url(f"runs/{cfg.run_name}/config.json"),
           "--shards", shard_key, "--cache-dir", str(tmp_path / "cache")]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo",
           "STOKER_STORAGE_OPTIONS": json.dumps(cfg.storage.storage_options)}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _metric(line):
    if "STOKER_METRIC " not in line:
        return None
    return json.loads(line.split("STOKER_METRIC ", 1)[1])


def test_checkpoints_land_in_s3_with_manifests_and_load_in_a_fresh_process(s3_root, tmp_path):
    root, options = s3_root
    cfg = _s3_config(root, options, run_name="s3run", train={"max_steps": 8},
                     checkpoint={"interval_steps": 4})
    store, shards = prepare_shards(cfg)
    proc = _start(cfg, store, shards.key, tmp_path)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-4000:]
    refs = list_checkpoints(store, "s3run")
    assert [r.step for r in refs] == [8, 4]
    for ref in refs:
        verdict = validate_checkpoint(store, ref.key, deep=True)
        assert verdict, verdict.reason
        assert {".metadata", "train_state.json", "__0_0.distcp", "__1_0.distcp"} <= set(verdict.manifest["files"])
        assert verdict.manifest["world_size"] == 2 and verdict.manifest["shard_key"] == shards.cache_key
    assert not os.listdir(tmp_path / "cache" / "staging" / "runs" / "s3run" / "checkpoints")  # staging cleared

    # a fresh process (no process group) loads the checkpoint from S3 and evaluates it
    ev = subprocess.run(
        [sys.executable, "-m", "training.evaluate", "--config", store.url("runs/s3run/config.json"),
         "--checkpoint", refs[0].key, "--shards", shards.key, "--cache-dir", str(tmp_path / "cache2")],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "STOKER_STORAGE_OPTIONS": json.dumps(options)})
    assert ev.returncode == 0, ev.stderr[-3000:]
    [result] = [e for e in map(events.decode, ev.stdout.splitlines()) if isinstance(e, events.Evaluated)]
    assert result.step == 8 and result.val_loss > 0


def test_s3_outage_during_upload_delays_but_loses_no_checkpoint(s3_server, s3_root, tmp_path):
    root, options = s3_root
    proxy = TcpProxy(s3_server.port)
    proxy.start()
    flaky = {**options, "endpoint_url": proxy.url,
             "config_kwargs": {"connect_timeout": 1, "read_timeout": 5, "retries": {"max_attempts": 1}}}
    cfg = _s3_config(root, flaky, run_name="outage", train={"max_steps": 12, "warmup_steps": 2},
                     checkpoint={"interval_steps": 4, "keep_latest_k": 10})
    store, shards = prepare_shards(cfg)
    proc = _start(cfg, store, shards.key, tmp_path)
    events, steps_while_down, down_since = [], [], None
    try:
        for line in proc.stdout:
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
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
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
