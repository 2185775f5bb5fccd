import math
import random
import tempfile

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from storage.checkpoints import list_checkpoints, validate_checkpoint
from storage.store import Store
from storage.uploader import CheckpointUploader
from training.checkpoint import load_checkpoint, model_optim_tensors, rng_state_tensors, save_state, scalar_state
from core.config import ModelConfig
from training.model import GPT, param_groups


def save_checkpoint(store, run_name, *, model, optimizer, scheduler, step, tokens_seen, seed, rank,
                    world_size, meta, keep_latest_k):
    """Save and commit synchronously, as a rank does with checkpoint.async_enabled=False."""
    uploader = CheckpointUploader(store, run_name, rank=rank, world_size=world_size,
                                  staging_root=tempfile.mkdtemp(prefix="stoker-staging-"), keep_latest_k=keep_latest_k,
                                  upload_timeout=300, commit_timeout=300, async_enabled=False)
    state = {**model_optim_tensors(model, optimizer), **rng_state_tensors(rank)}
    key = save_state(uploader, state, scalar_state(optimizer, scheduler, step, tokens_seen, seed), step,
                     {"tokens_seen": tokens_seen, **meta})
    assert not uploader.failures, uploader.failures
    return key, 0.0


def _build(seed=0):
    torch.manual_seed(seed)
    model = GPT(ModelConfig(n_layer=1, n_head=2, n_embd=16, block_size=8), vocab_size=50)
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
    torch.manual_seed(7); np.random.seed(7); random.seed(7); random.gauss(0, 1)
    key, _ = save_checkpoint(store, "r", model=model, optimizer=opt, scheduler=sched, step=3,
                             tokens_seen=48, seed=0, rank=0, world_size=1, meta={}, keep_latest_k=2)
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
    kw = dict(model=model, optimizer=opt, scheduler=sched, step=1, tokens_seen=1, seed=0, rank=0,
              world_size=1, meta={}, keep_latest_k=2)
    store.write_bytes("runs/r/checkpoints/step-00000001/partial.distcp", b"junk")  # a crashed attempt
    key, _ = save_checkpoint(store, "r", **kw)
    assert key.endswith("step-00000001.a1")
    assert [r.name for r in list_checkpoints(store, "r")] == ["step-00000001.a1", "step-00000001"]


def test_load_refuses_a_checkpoint_with_pickled_entries(tmp_path):
    store = Store("file://" + str(tmp_path))
    model, _, _ = _build()
    state = {f"model.{n}": p.detach() for n, p in model.named_parameters()}
    state["model.wte.weight"] = "pickled object"  # a non-tensor where a tensor belongs
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "bad")))
    with pytest.raises(ValueError, match="non-tensor"):
        load_checkpoint(str(tmp_path / "bad"), model=_build()[0])


def test_to_host_passes_cpu_tensors_through():
    from training.checkpoint import to_host

    t = torch.arange(4.0)
    assert to_host({"a": t}, {})["a"] is t


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_to_host_stages_cuda_tensors_in_reused_pinned_buffers():
    from training.checkpoint import to_host

    buffers = {}
    t = torch.randn(1000, device="cuda")
    first = to_host({"w": t}, buffers)["w"]
    assert first.is_pinned() and torch.equal(first, t.cpu())
    t.add_(1)
    second = to_host({"w": t}, buffers)["w"]
    assert second.data_ptr() == first.data_ptr() and torch.equal(second, t.cpu())
