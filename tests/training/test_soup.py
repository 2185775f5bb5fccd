"""Soups (storage.soups, training.soup_main) with real parts: one 'wsd' run of 8 steps on 2 forked
gloo ranks under FSDP2 (checkpoints at 4, 6 where its decay begins, and 8) serves every test: each
averaged tensor is the fp32 average of its inputs, bit for bit; the soup of the sharded checkpoints
equals the soup of the same weights saved by one rank; the soup loads as a checkpoint does (model,
optimizer, scheduler); every bad input is one line before any compute, and nothing is written."""

import json
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from stoker.config import ConfigError, load_config
from stoker.storage.checkpoints import COMMIT_FILE, commit_checkpoint, list_checkpoints
from stoker.storage.runs import pin_run_folder
from stoker.storage.soups import resolve_soup
from stoker.storage.store import Store, join
from stoker.training.soup_main import averaged, make_soup
from tests.conftest import prepare_shards, tiny_dict
from tests.forked_ranks import run_forked

WSD = {"lr_schedule": "wsd", "decay_steps": 2, "warmup_steps": 2, "max_steps": 8}


def _tensors(store: Store, key: str) -> dict[str, torch.Tensor]:
    path = store.local_path(key)
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.items()}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return sd


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """torch.equal, a NaN equal to a NaN (an RNG state's unset Gaussian)."""
    return torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)))


def _files(store: Store) -> dict[str, int]:
    return store.walk_files("")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = "file://" + str(tmp_path_factory.mktemp("soup") / "store")
    # every checkpoint kept: none dropped by the upload backpressure (two pending by default)
    ckpt = {"interval_steps": 4, "keep_latest_k": 8, "max_pending_uploads": 8}
    sections = tiny_dict(root, run_name="p", checkpoint=ckpt, engine={"parallelism": "fsdp"})
    sections["train"].update(WSD)
    cfg = load_config(sections)
    store, shards = prepare_shards(cfg)
    run_forked(pin_run_folder(store, cfg, shards), shards.key, nproc=2)
    assert [c.step for c in list_checkpoints(store, "p")] == [8, 6, 4]
    return store, cfg, str(tmp_path_factory.mktemp("soup-cache"))


def _uri(store, run, step):
    return store.url(f"runs/{run}/checkpoints/step-{step:08d}")


def test_each_averaged_tensor_is_the_fp32_average_of_its_inputs_and_the_soup_loads(run):
    from stoker.families import build_model
    from stoker.training.checkpoint import load_checkpoint

    store, cfg, cache = run
    plan = resolve_soup([_uri(store, "p", 4), _uri(store, "p", 6)], [0.25, 0.75], "s1")
    done = make_soup(json.loads(plan.to_json()), cache)
    assert done.step == 6 and done.key == "runs/s1/checkpoints/step-00000006"
    got, a, b = _tensors(store, done.key), _tensors(store, plan.inputs[0].key), _tensors(store, plan.inputs[1].key)
    assert got.keys() == b.keys()
    checked = 0
    for key, tensor in got.items():
        if averaged(key):  # computed here independently: w0 * x0 + w1 * x1 in fp32, cast back
            want = (0.25 * a[key].float() + 0.75 * b[key].float()).to(b[key].dtype)
            assert torch.equal(tensor, want), key
            checked += 1
        else:  # the lead's (step 6): the optimizer's step counters, the RNG states
            assert _equal(tensor, b[key]), key
    assert checked == done.num_averaged and any(k.endswith(".exp_avg_sq") for k in got)
    manifest = store.read_json(join(done.key, COMMIT_FILE))
    assert manifest["run_name"] == "s1" and manifest["soup"]["id"] == plan.soup_id and manifest["numerics"] == "finite"
    # it loads as any checkpoint does: model, optimizer and scheduler, at the lead's step
    model = build_model(cfg.model, int(store.read_json("runs/p/shards.json")["vocab_size"]), seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    state = load_checkpoint(store.local_path(done.key), model=model, optimizer=optimizer, scheduler=scheduler)
    assert state.step == 6
    # the same soup is found again, not recomputed (storage.soups.soup_checkpoint)
    from stoker.storage.soups import soup_checkpoint

    assert (
        soup_checkpoint(store, resolve_soup([_uri(store, "p", 4), _uri(store, "p", 6)], [0.25, 0.75], "s1")) == done.key
    )


def _one_rank_copy(store: Store, src_run: str, step: int, dst_run: str) -> str:
    """The same weights as run `src_run`'s checkpoint, saved by one process (whole tensors)."""
    src = f"runs/{src_run}/checkpoints/step-{step:08d}"
    dst = f"runs/{dst_run}/checkpoints/step-{step:08d}"
    for name in ("config.json", "shards.json", "tokenizer.json"):
        store.copy(f"runs/{src_run}/{name}", f"runs/{dst_run}/{name}")
    dcp.save(_tensors(store, src), storage_writer=dcp.FileSystemWriter(store.local_path(dst)), no_dist=True)
    store.copy(join(src, "train_state.json"), join(dst, "train_state.json"))
    meta = {k: v for k, v in store.read_json(join(src, COMMIT_FILE)).items() if k not in ("files", "committed_at")}
    commit_checkpoint(store, dst, {**meta, "run_name": dst_run})
    return store.url(dst)


def test_a_soup_of_a_sharded_checkpoint_equals_the_soup_of_the_same_weights_saved_by_one_rank(run):
    store, cfg, cache = run
    files = dcp.FileSystemReader(store.local_path("runs/p/checkpoints/step-00000004")).read_metadata()
    sharded = [k for k, v in files.state_dict_metadata.items() if k.startswith("model.") and len(v.chunks) == 2]
    assert sharded, "FSDP2 on 2 ranks stores each weight as 2 chunks"
    one = _one_rank_copy(store, "p", 4, "p-one-rank")
    a = make_soup(
        json.loads(resolve_soup([_uri(store, "p", 4), _uri(store, "p", 8)], None, "s-sharded").to_json()), cache
    )
    b = make_soup(json.loads(resolve_soup([one, _uri(store, "p", 8)], None, "s-one-rank").to_json()), cache)
    x, y = _tensors(store, a.key), _tensors(store, b.key)
    assert x.keys() == y.keys() and [k for k in x if not _equal(x[k], y[k])] == []


def test_every_bad_soup_is_one_line_before_any_compute_and_nothing_is_written(run, tmp_path):
    store, cfg, cache = run
    at4, at6, at8 = (_uri(store, "p", s) for s in (4, 6, 8))

    def copy_run(name: str) -> str:
        shutil.copytree(store.local_path("runs/p"), store.local_path(f"runs/{name}"))
        return name

    other_model = copy_run("other-model")  # another architecture: its manifest's model hash
    key = "runs/other-model/checkpoints/step-00000008"
    meta = {k: v for k, v in store.read_json(join(key, COMMIT_FILE)).items() if k not in ("files", "committed_at")}
    store.rm(join(key, COMMIT_FILE))
    commit_checkpoint(store, key, {**meta, "run_name": other_model, "model_hash": "0" * 64})
    copy_run("other-tokenizer")
    store.write_bytes("runs/other-tokenizer/tokenizer.json", b'{"model": "another"}')
    copy_run("other-vocab")
    shards = store.read_json("runs/other-vocab/shards.json")
    store.write_json("runs/other-vocab/shards.json", {**shards, "vocab_size": shards["vocab_size"] + 1})
    copy_run("uncommitted")
    store.rm("runs/uncommitted/checkpoints/step-00000008/commit.json")
    copy_run("damaged")
    path = os.path.join(store.local_path("runs/damaged/checkpoints/step-00000008"), "__0_0.distcp")
    with open(path, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    before = _files(store)

    def refused(checkpoints, weights=None, **kw) -> str:
        with pytest.raises(ConfigError) as err:
            resolve_soup(checkpoints, weights, **kw)
        [line] = err.value.problems
        return line

    def uri(run_name):
        return _uri(store, run_name, 8)

    assert "holds another architecture" in refused([at4, uri("other-model")])
    assert "another tokenizer" in refused([at4, uri("other-tokenizer")])
    assert "vocabulary of" in refused([at4, uri("other-vocab")])
    assert "it is not committed" in refused([at4, uri("uncommitted")])
    assert "is not intact" in refused([at4, uri("damaged")])
    assert refused([at4, at6], [0.5, 0.6]).startswith("--weights: they sum to 1.1, not 1")
    assert refused([at4, at6], [1.5, -0.5]).startswith("--weights: -0.5 is negative")
    assert refused([at4, at6], [1.0]).startswith("--weights: 1 weight(s) for 2 checkpoints")
    assert refused([at4]).startswith("checkpoints: 1 given; a soup averages two checkpoints at least")
    root = store.root
    assert "spans a decay: step(s) 8 lie past the stable part (to step 6)" in refused(["p"], root=root, last=2)
    assert refused(["p"], root=root, steps="2..5").startswith("p: steps 2..5 hold(s) 1 committed checkpoint(s)")
    assert _files(store) == before  # nothing written by any refusal
    # a window of one phase is a soup; asked for, one across the decay too
    assert [i.step for i in resolve_soup(["p"], root=root, steps="0..6").inputs] == [4, 6]
    assert [i.step for i in resolve_soup(["p"], root=root, last=2, across_decay=True).inputs] == [6, 8]
    assert at8
