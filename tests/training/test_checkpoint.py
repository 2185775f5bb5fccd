import math
import random
import tempfile

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from stoker.families.gpt2.config import GPT2Config
from stoker.families.gpt2.model import GPT
from stoker.families.spec import param_groups
from stoker.storage.checkpoints import list_checkpoints, validate_checkpoint
from stoker.storage.store import Store
from stoker.storage.uploader import CheckpointUploader
from stoker.training.checkpoint import Checkpointer, load_checkpoint


def save_checkpoint(
    store,
    run_name,
    *,
    model,
    optimizer,
    scheduler,
    step,
    tokens_seen,
    seed,
    rank,
    world_size,
    meta,
    keep_latest_k,
    async_enabled=False,
):
    """Save and commit (synchronously, as a rank does with checkpoint.async_enabled=False)."""
    committed = []
    uploader = CheckpointUploader(
        store,
        run_name,
        rank=rank,
        world_size=world_size,
        staging_root=tempfile.mkdtemp(dir=_STAGING.name),
        keep_latest_k=keep_latest_k,
        upload_timeout=300,
        commit_timeout=300,
        async_enabled=async_enabled,
        on_event=committed.append,
    )
    ckpt = Checkpointer(
        uploader,
        model,
        optimizer,
        scheduler,
        rank=rank,
        world_size=world_size,
        device=torch.device("cpu"),
        seed=seed,
        global_batch_size=2,
    )
    stall = ckpt.save(step, tokens_seen, {"tokens_seen": tokens_seen, **meta})
    return uploader, committed, stall


# each uploader's staging folder lives in here, removed when the test process ends (an
# uploader may still write into its folder after save_checkpoint returns)
_STAGING = tempfile.TemporaryDirectory(prefix="stoker-staging-")


def save_and_commit(store, run_name, **kw):
    uploader, committed, stall = save_checkpoint(store, run_name, **kw)
    uploader.wait()
    assert not uploader.failures, uploader.failures
    return [e.key for e in committed if e.kind == "checkpoint"][0], stall


def _build(seed=0):
    torch.manual_seed(seed)
    model = GPT(
        GPT2Config(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_pad_multiple=1), vocab_size=50, seed=seed
    )
    opt = torch.optim.AdamW(param_groups(model, 0.1), lr=1e-2, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1))
    return model, opt, sched


def _train(model, opt, sched, steps):
    for _ in range(steps):
        x = torch.randint(0, 50, (2, 8))
        _, loss = model(x, x)
        loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()


def test_gpt_forward_shapes_and_tied_weights():
    model, _, _ = _build()
    logits, loss = model(torch.zeros(3, 8, dtype=torch.long), torch.zeros(3, 8, dtype=torch.long))
    assert logits.shape == (3, 8, 50) and loss.ndim == 0
    assert model.lm_head.weight is model.wte.weight


def test_checkpoint_round_trip_restores_every_tensor_and_rng(tmp_path):
    store = Store("file://" + str(tmp_path))
    model, opt, sched = _build()
    _train(model, opt, sched, 3)
    torch.manual_seed(7)
    np.random.seed(7)
    random.seed(7)
    random.gauss(0, 1)
    key, _ = save_and_commit(
        store,
        "r",
        model=model,
        optimizer=opt,
        scheduler=sched,
        step=3,
        tokens_seen=48,
        seed=0,
        rank=0,
        world_size=1,
        meta={},
        keep_latest_k=2,
    )
    assert validate_checkpoint(store, key, deep=True)
    expected_rng = (torch.rand(3), np.random.rand(3), random.random())
    _train(model, opt, sched, 2)  # move on, so the load has something to undo
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}

    fresh, fopt, fsched = _build(seed=123)
    state = load_checkpoint(store.local_path(key), model=fresh, optimizer=fopt, scheduler=fsched, rank=0)
    assert (state.step, state.tokens_seen) == (3, 48)
    got_rng = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(got_rng[0], expected_rng[0])
    assert np.array_equal(got_rng[1], expected_rng[1]) and got_rng[2] == expected_rng[2]
    assert fsched.last_epoch == 3 and math.isclose(fopt.param_groups[0]["lr"], 1e-2 / 4)
    _train(fresh, fopt, fsched, 2)  # the same two steps (same RNG) give the same weights
    for n, p in fresh.named_parameters():
        assert torch.equal(p, expected[n]), n


def test_new_attempt_never_reuses_a_folder(tmp_path):
    store = Store("file://" + str(tmp_path))
    model, opt, sched = _build()
    _train(model, opt, sched, 1)
    kw = dict(
        model=model,
        optimizer=opt,
        scheduler=sched,
        step=1,
        tokens_seen=1,
        seed=0,
        rank=0,
        world_size=1,
        meta={},
        keep_latest_k=2,
    )
    store.write_bytes("runs/r/checkpoints/step-00000001/partial.distcp", b"junk")  # a crashed attempt
    key, _ = save_and_commit(store, "r", **kw)
    assert key.endswith("step-00000001.a1")
    # the crashed attempt's folder was never written into; retention removed it after the commit
    assert [r.name for r in list_checkpoints(store, "r")] == ["step-00000001.a1"]


def test_load_refuses_a_checkpoint_with_pickled_entries(tmp_path):
    model, _, _ = _build()
    state = {f"model.{n}": p.detach() for n, p in model.named_parameters()}
    state["model.wte.weight"] = "pickled object"  # a non-tensor where a tensor belongs
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "bad")))
    with pytest.raises(ValueError, match="non-tensor"):
        load_checkpoint(str(tmp_path / "bad"), model=_build()[0])


def test_async_save_writes_the_state_of_its_step_while_training_goes_on(tmp_path):
    """The training thread only copies the state; the write happens on the upload thread,
    and what lands is the state at save time, not the state after later steps."""
    store = Store("file://" + str(tmp_path))
    model, opt, sched = _build()
    _train(model, opt, sched, 2)
    at_save = {n: p.detach().clone() for n, p in model.named_parameters()}
    uploader, committed, _ = save_checkpoint(
        store,
        "r",
        model=model,
        optimizer=opt,
        scheduler=sched,
        step=2,
        tokens_seen=32,
        seed=0,
        rank=0,
        world_size=1,
        meta={},
        keep_latest_k=2,
        async_enabled=True,
    )
    _train(model, opt, sched, 3)  # races the background write
    uploader.wait()
    assert not uploader.failures, uploader.failures
    kinds = [e.kind for e in committed]
    assert kinds == ["checkpoint_staged", "checkpoint"], kinds
    fresh, fopt, fsched = _build(seed=5)
    load_checkpoint(store.local_path(committed[-1].key), model=fresh, optimizer=fopt, scheduler=fsched)
    for n, p in fresh.named_parameters():
        assert torch.equal(p, at_save[n]), n


def test_a_checkpoint_of_another_world_size_loads_with_fresh_rng_streams(tmp_path):
    store = Store("file://" + str(tmp_path))
    model, opt, sched = _build()
    _train(model, opt, sched, 1)
    key, _ = save_and_commit(
        store,
        "r",
        model=model,
        optimizer=opt,
        scheduler=sched,
        step=1,
        tokens_seen=16,
        seed=0,
        rank=0,
        world_size=1,
        meta={},
        keep_latest_k=2,
    )
    fresh, fopt, fsched = _build(seed=9)
    state = load_checkpoint(
        store.local_path(key), model=fresh, optimizer=fopt, scheduler=fsched, rank=1, world_size=2, seed=0
    )
    assert state.step == 1 and not state.rng_restored
    for (n, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p, q), n


def test_init_is_a_function_of_the_seed_and_names_only():
    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=16, block_size=8)
    torch.manual_seed(1)
    a = GPT(cfg, 50, seed=4)
    torch.manual_seed(2)  # the global RNG plays no part
    b = GPT(cfg, 50, seed=4)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.wte.weight, GPT(cfg, 50, seed=5).wte.weight)
    assert a.wte.weight.shape[0] == 128  # padded to vocab_pad_multiple; ids < 50 unchanged
    logits, _ = a(torch.zeros(1, 8, dtype=torch.long))
    assert logits.shape == (1, 8, 50)
