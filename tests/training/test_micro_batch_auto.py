"""train.micro_batch_size 'auto' on real ranks (forked, gloo): the ranks settle a value the
plan fits in the device memory given (launch.device_memory_gib), keep the global batch, say
so in one event, and train bitwise the run with that value set by hand."""

import torch
import torch.distributed.checkpoint as dcp

from stoker.arithmetic import plan as plans
from stoker.storage.checkpoints import list_checkpoints
from tests.conftest import prepare_shards, train_losses
from tests.forked_ranks import run_forked


def _tensors(path):
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.items()}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return sd


def _run(tiny_config, name, micro, memory_gib=None):
    launch = {"nproc_per_node": 2, **({"device_memory_gib": memory_gib} if memory_gib else {})}
    cfg = tiny_config(
        run_name=name,
        train={"max_steps": 3, "global_batch_size": 8, "micro_batch_size": micro},
        checkpoint={"interval_steps": 3},
        eval={"interval_steps": 100, "per_checkpoint_enabled": False},
        launch=launch,
    )
    store, shards = prepare_shards(cfg)
    store.write_bytes(f"runs/{name}/config.json", cfg.to_json().encode())
    records = run_forked(store.url(f"runs/{name}/config.json"), shards.key, nproc=2)
    [newest] = list_checkpoints(store, name)[:1]
    return cfg, records, _tensors(store.local_path(newest.key))


def test_auto_picks_what_fits_keeps_the_global_batch_and_trains_the_same_run_bitwise(tiny_config):
    probe = tiny_config(train={"global_batch_size": 8, "micro_batch_size": "auto"}, launch={"nproc_per_node": 2})
    # a device memory between the plan of 2 and of 4 sequences a rank: 'auto' must pick 2
    two, four = (plans.plan(probe, plans.Hardware.cpu(1), micro_batch=m).allocated for m in (2, 4))
    memory_gib = (two + four) / 2 / plans.GIB
    cfg, records, auto = _run(tiny_config, "auto", "auto", memory_gib)
    [chosen] = [r for r in records if r["event"] == "micro_batch"]
    assert chosen["micro_batch_size"] == 2 and chosen["planned"] == 2 and not chosen["probed"]  # no probe on CPUs
    assert chosen["accum"] == 2 and chosen["micro_batch_size"] * chosen["accum"] * 2 == cfg.train.global_batch_size
    _, by_hand_records, by_hand = _run(tiny_config, "hand", 2)
    assert train_losses(records) == train_losses(by_hand_records)
    assert auto.keys() == by_hand.keys()
    for k in auto:  # python's cached gauss is stored as NaN when there is none
        assert torch.equal(auto[k], by_hand[k]) or (auto[k].isnan().all() and by_hand[k].isnan().all()), k
