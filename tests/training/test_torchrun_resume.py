"""Real torchrun with 2 gloo ranks: a resumed run ends bit for bit where an unbroken one does."""

import torch
import torch.distributed.checkpoint as dcp

from storage.checkpoints import list_checkpoints, validate_checkpoint
from tests.conftest import prepare_shards, run_ranks, train_losses


def _torchrun(config_url, shard_key, resume=None):
    return train_losses(run_ranks(config_url, shard_key, resume))


def _tensors(path):
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.items()}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return sd


def test_resumed_run_equals_uninterrupted_run_bitwise(tiny_config):
    cfg = tiny_config(run_name="bitwise", train={"max_steps": 6}, checkpoint={"interval_steps": 3})
    store, shards = prepare_shards(cfg)
    store.write_bytes("runs/bitwise/config.json", cfg.to_json().encode())
    config_url = store.url("runs/bitwise/config.json")

    unbroken = _torchrun(config_url, shards.key)
    assert sorted(unbroken) == [1, 2, 3, 4, 5, 6]
    names = [r.name for r in list_checkpoints(store, "bitwise")]
    assert names == ["step-00000006", "step-00000003"]

    resumed = _torchrun(config_url, shards.key, resume="runs/bitwise/checkpoints/step-00000003")
    assert sorted(resumed) == [4, 5, 6]
    assert all(resumed[s] == unbroken[s] for s in resumed)  # same per-step losses, exactly

    a_key, b_key = "runs/bitwise/checkpoints/step-00000006", "runs/bitwise/checkpoints/step-00000006.a1"
    assert validate_checkpoint(store, b_key, deep=True)
    a, b = _tensors(store.local_path(a_key)), _tensors(store.local_path(b_key))
    assert a.keys() == b.keys()
    assert any(k.startswith("optim.") and k.endswith("exp_avg_sq") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]) or (a[k].isnan().all() and b[k].isnan().all()), k
