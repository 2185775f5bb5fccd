"""Real gloo ranks: a resumed run ends bit for bit where an unbroken one does (one unbroken run
per world size for the module: `unbroken`). Where torchrun is not the subject the ranks are
forked (tests.forked_ranks); torchrun's in-place restart, and its refusal to restart a
permanent failure, run under real torchrun, against the same (forked) unbroken run."""

import pytest
import torch
import torch.distributed.checkpoint as dcp

from stoker.config import RunConfig
from stoker.storage.checkpoints import list_checkpoints, validate_checkpoint
from tests.conftest import prepare_shards, run_ranks, tiny_dict, train_losses
from tests.forked_ranks import run_forked


def _train(config_url, shard_key, resume=None, nproc=2):
    return train_losses(run_forked(config_url, shard_key, resume, nproc=nproc))


def _tensors(path):
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.items()}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return sd


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory):
    """The module's unbroken runs, one per world size, each made once: 8 steps, checkpoints at
    4 and 8. Returns get(ranks) -> (store, shards, config URL, run name, per-step losses)."""
    from stoker.config import load_config

    made = {}

    def get(ranks: int):
        if ranks not in made:
            run = f"bitwise-{ranks}"
            root = "file://" + str(tmp_path_factory.mktemp(run) / "store")
            cfg = load_config(
                tiny_dict(
                    root,
                    run_name=run,
                    train={"max_steps": 8},
                    checkpoint={"interval_steps": 4},
                    launch={"nproc_per_node": ranks},
                )
            )
            store, shards = prepare_shards(cfg)
            store.write_bytes(f"runs/{run}/config.json", cfg.to_json().encode())
            url = store.url(f"runs/{run}/config.json")
            losses = _train(url, shards.key, nproc=ranks)
            assert sorted(losses) == [1, 2, 3, 4, 5, 6, 7, 8]
            assert [r.name for r in list_checkpoints(store, run)] == ["step-00000008", "step-00000004"]
            made[ranks] = (store, shards, url, run, losses)
        return made[ranks]

    return get


@pytest.mark.parametrize("ranks", [2, 4])
def test_resumed_run_equals_uninterrupted_run_bitwise(unbroken, ranks):
    """With 4 ranks a ring all-reduce adds more than two numbers, so the order of gradients in
    DDP's buckets matters: DDP's rebuild of its buckets after its first step would differ
    between the unbroken run and the resumed one (train.deterministic keeps them fixed)."""
    store, shards, config_url, run, whole = unbroken(ranks)
    resumed = _train(config_url, shards.key, resume=f"runs/{run}/checkpoints/step-00000004", nproc=ranks)
    assert sorted(resumed) == [5, 6, 7, 8]
    assert all(resumed[s] == whole[s] for s in resumed)  # same per-step losses, exactly

    a_key, b_key = f"runs/{run}/checkpoints/step-00000008", f"runs/{run}/checkpoints/step-00000008.a1"
    assert validate_checkpoint(store, b_key, deep=True)
    a, b = _tensors(store.local_path(a_key)), _tensors(store.local_path(b_key))
    assert a.keys() == b.keys()
    assert any(k.startswith("optim.") and k.endswith("exp_avg_sq") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]) or (a[k].isnan().all() and b[k].isnan().all()), k


def test_ranks_fall_back_together_from_a_checkpoint_their_full_check_rejects(tiny_config):
    """The choice of a resume point reads no tensor bytes; the ranks' full check does. A flipped
    byte in the chosen checkpoint is found there: it is marked invalid in the store and every
    rank resumes from the previous valid one, reporting the one passed over."""
    cfg = tiny_config(run_name="fallback", train={"max_steps": 4}, checkpoint={"interval_steps": 2})
    store, shards = prepare_shards(cfg)
    store.write_bytes("runs/fallback/config.json", cfg.to_json().encode())
    run_forked(store.url("runs/fallback/config.json"), shards.key)
    newest = "runs/fallback/checkpoints/step-00000004"
    shard = sorted(n for n in store.walk_files(newest) if n.endswith(".distcp"))[0]
    data = store.read_bytes(f"{newest}/{shard}")
    store.write_bytes(f"{newest}/{shard}", data[:64] + bytes([data[64] ^ 1]) + data[65:])

    longer = cfg.model_copy(update={"train": cfg.train.model_copy(update={"max_steps": 6})})
    store.write_bytes("runs/fallback/config-6.json", longer.to_json().encode())
    records = run_forked(store.url("runs/fallback/config-6.json"), shards.key, resume=newest)
    [resumed] = [r for r in records if r["event"] == "resumed"]
    assert resumed["step"] == 2 and resumed["passed_over"] == [store.url(newest)]
    assert sorted(train_losses(records)) == [3, 4, 5, 6]
    assert not validate_checkpoint(store, newest)  # marked: no later choice takes it


def test_a_killed_rank_is_restarted_in_place_and_ends_bitwise_like_an_unbroken_run(unbroken, tmp_path):
    """torchrun --max-restarts=1, rank 1 SIGKILLed before step 6 (once): the restart round's
    ranks, launched without --resume-from, find the newest valid checkpoint (step 4)
    themselves and finish where an unbroken run does, bit for bit."""
    store, shards, url, run, whole = unbroken(2)
    final_a = _tensors(store.local_path(f"runs/{run}/checkpoints/step-00000008"))

    cfg = RunConfig.model_validate_json(store.read_bytes(f"runs/{run}/config.json"))
    other = cfg.model_copy(update={"run_name": "inplace-killed"})
    store.write_bytes("runs/inplace-killed/config.json", other.to_json().encode())
    fault = {"STOKER_FAULT": "kill:rank=1:step=6", "STOKER_FAULT_ONCE": str(tmp_path / "fired")}
    records = run_ranks(store.url("runs/inplace-killed/config.json"), shards.key, max_restarts=1, env=fault)
    assert (tmp_path / "fired").exists()
    resumed = [r for r in records if r["event"] == "resumed"]
    assert [r["step"] for r in resumed] == [4]  # the restart took the newest valid one itself
    losses = train_losses(records)
    assert all(losses[s] == whole[s] for s in losses)
    newest = list_checkpoints(store, "inplace-killed")[0]
    assert newest.step == 8
    final_b = _tensors(store.local_path(newest.key))
    for k in final_a:
        assert torch.equal(final_a[k], final_b[k]) or (final_a[k].isnan().all() and final_b[k].isnan().all()), k


def test_a_permanent_failure_is_not_restarted(tiny_config, tmp_path):
    """One rank is enough: the rank that failed for good files the marker, and the restart
    round's rank reads it and ends at once."""
    import os
    import subprocess

    from stoker.launch.torchrun import AGENT, free_port
    from tests.conftest import ROOT

    cfg = tiny_config(run_name="perm", train={"max_steps": 4}, launch={"nproc_per_node": 1})
    store, shards = prepare_shards(cfg)
    store.write_bytes("runs/perm/config.json", cfg.to_json().encode())
    marker = tmp_path / "permanent.json"
    env = {
        **os.environ,
        "GLOO_SOCKET_IFNAME": "lo",
        "STOKER_FAULT": "raise:rank=0:step=2",
        "STOKER_PERMANENT_FAILURE_FILE": str(marker),
    }
    out = subprocess.run(
        [
            *AGENT,
            "--nproc-per-node=1",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}",
            "--max-restarts=1",  # one restart round shows it: it ends at once, without training
            "--tee=3",
            "-m",
            "stoker.training.train",
            "--config",
            store.url("runs/perm/config.json"),
            "--shards",
            shards.key,
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode != 0 and marker.exists()
    trains = [l for l in out.stdout.splitlines() if '"event": "train"' in l and '"step": 1,' in l]
    # the first attempt trained step 1; the restarts ended at once without training again
    assert len(trains) == 1, trains
    assert "not restarted: rank 0 failed with RuntimeError: injected fault" in out.stdout + out.stderr
