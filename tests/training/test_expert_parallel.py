"""Expert parallel (engine.ep_degree: a mixture's experts split over groups of ranks, tokens
dispatched by all-to-all, families.moe; composed with FSDP2 in training.engine) on CPU ranks
with gloo (forked: tests.forked_ranks), on a tiny random Qwen3-MoE (4 experts, top-2).

One module run set: plain FSDP2 on 2 ranks (ep 1, the reference), ep 2 on 2 ranks, ep 2 on
4 ranks (2 x 2: the experts FSDP2-sharded over 2 ranks holding the same experts), each 10
steps with checkpoints at 5 and 10, and the ep-2 run's step-5 checkpoint resumed at ep 1.
The global batch is the same under every mesh (8 sequences a step), so each step sees the
same tokens: the losses agree within 1e-5 (measured: bit for bit on this host), and so do the
checkpoints' weights and AdamW moments, tensor by tensor (a wrong gradient scale of the
experts, which AdamW's update all but hides in the losses, doubles their first moment).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from stoker.config import load_config
from stoker.failures import ConfigError
from stoker.storage.checkpoints import COMMIT_FILE
from tests.conftest import prepare_shards, tiny_dict, train_losses
from tests.forked_ranks import run_forked

MOE = {
    "family": "qwen3_moe",
    "n_layer": 2,
    "n_head": 4,
    "n_kv_head": 2,
    "n_embd": 32,
    "head_dim": 8,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "mlp_only_layers": [],
    "block_size": 32,
    "router_aux_loss_coef": 0.01,
}
STEPS = 10
TOL = dict(rtol=0.0, atol=1e-5)


def _config(root: str, run_name: str, nproc: int, **engine):
    return load_config(
        tiny_dict(
            root,
            run_name=run_name,
            model=MOE,
            engine={"parallelism": "fsdp", **engine},
            launch={"nproc_per_node": nproc},
            train={"max_steps": STEPS, "micro_batch_size": 2},
            checkpoint={"interval_steps": 5, "keep_latest_k": 4},
            eval={"interval_steps": 5},
        )
    )


def _run(store, shards, cfg, name: str, nproc: int, resume: str | None = None) -> list[dict]:
    key = f"runs/{cfg.run_name}/{name}.json"
    store.write_bytes(key, cfg.to_json().encode())
    return run_forked(store.url(key), shards.key, resume=resume, nproc=nproc)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = "file://" + str(tmp_path_factory.mktemp("ep") / "store")
    ep1 = _config(root, "ep-1", 2)
    store, shards = prepare_shards(ep1)
    out = {
        "ep1": _run(store, shards, ep1, "ep1", 2),
        "ep2": _run(store, shards, _config(root, "ep-2", 2, ep_degree=2), "ep2", 2),
        "ep2x2": _run(store, shards, _config(root, "ep-2x2", 4, ep_degree=2), "ep2x2", 4),
    }
    # the ep-2 run, resumed at ep 1 (engine and launch are no part of a run's identity)
    resumed = _config(root, "ep-2", 2)
    out["resumed"] = _run(store, shards, resumed, "resumed", 2, resume="runs/ep-2/checkpoints/step-00000005")
    return out, store


def _losses(records, steps) -> torch.Tensor:
    losses = train_losses(records)
    return torch.tensor([losses[s] for s in steps], dtype=torch.float64)


def _tensors(path: str) -> dict[str, torch.Tensor]:
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.items() if not k.startswith("rng.")}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return sd


def test_expert_parallel_on_2_and_4_ranks_trains_like_plain_fsdp2(runs):
    out, store = runs
    steps = list(range(1, STEPS + 1))
    reference = _losses(out["ep1"], steps)
    for name, run in (("ep2", "ep-2"), ("ep2x2", "ep-2x2")):
        torch.testing.assert_close(_losses(out[name], steps), reference, **TOL, msg=lambda m, n=name: f"{n}: {m}")
        manifest = store.read_json(f"runs/{run}/checkpoints/step-00000010/{COMMIT_FILE}")
        assert '"ep_degree": 2' in json.dumps(manifest), manifest
        ours = _tensors(store.local_path(f"runs/{run}/checkpoints/step-00000010"))
        plain = _tensors(store.local_path("runs/ep-1/checkpoints/step-00000010"))
        assert ours.keys() == plain.keys() and any(".experts.gate_proj" in k and k.startswith("optim.") for k in ours)
        for k in ours:  # the full tensors whatever the mesh: weights and both AdamW moments
            torch.testing.assert_close(ours[k], plain[k], msg=lambda m, k=k, n=name: f"{n} {k}: {m}")
    # the router's balance is logged under expert parallel too (summed over ranks)
    load = next(r for r in out["ep2x2"] if r["event"] == "train")["expert_load"]
    assert load["layers"] == [0, 1] and all(b >= 0.25 >= i for b, i in zip(load["busiest"], load["idlest"]))


def test_an_expert_parallel_checkpoint_resumes_at_ep_1_and_goes_on_as_the_unbroken_run(runs):
    out, store = runs
    resumed = train_losses(out["resumed"])
    assert sorted(resumed) == list(range(6, STEPS + 1))
    whole = train_losses(out["ep2"])
    # the step after the resume: the unbroken run's, bit for bit (the state loaded at ep 1 is
    # exactly the one the ep-2 ranks saved)
    assert resumed[6] == whole[6]
    steps = sorted(resumed)
    torch.testing.assert_close(_losses(out["resumed"], steps), _losses(out["ep2"], steps), **TOL)
    # what it loaded holds every expert whole, as the plain run's checkpoint does
    ep2 = _tensors(store.local_path("runs/ep-2/checkpoints/step-00000005"))
    plain = _tensors(store.local_path("runs/ep-1/checkpoints/step-00000005"))
    assert ep2.keys() == plain.keys() and ep2["model.layers.0.mlp.experts.gate_proj"].shape == (4, 16, 32)
    for k in ep2:
        torch.testing.assert_close(ep2[k], plain[k], msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize(
    ("sections", "said"),
    [
        ({"engine": {"parallelism": "fsdp", "ep_degree": 2}}, "has no experts to split (a dense model)"),
        ({"engine": {"parallelism": "ddp", "ep_degree": 2}, "model": MOE}, "under engine.parallelism 'fsdp' only"),
        ({"engine": {"parallelism": "fsdp", "ep_degree": 4}, "model": MOE}, "does not divide the world size 2"),
        (
            {"engine": {"parallelism": "fsdp", "ep_degree": 2}, "model": {**MOE, "num_experts": 5}},
            "does not divide model.num_experts=5",
        ),
        ({"model": {**MOE, "router_aux_loss_coef": -0.1}}, "model.router_aux_loss_coef: must be >= 0"),
        (
            {"engine": {"parallelism": "fsdp+tp", "tp_degree": 2}, "model": MOE},
            "'fsdp+tp' has a tensor-parallel plan for the llama, qwen3 families only",
        ),
    ],
)
def test_expert_parallel_that_cannot_run_is_refused_in_one_line_before_any_compute(sections, said, tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(tiny_dict(f"file://{tmp_path}/store", **sections))
    assert said in str(err.value) and len(err.value.problems) == 1, err.value.problems
    assert not (tmp_path / "store").exists()
