"""The mixture-of-experts families (stoker/families/qwen3_moe/, mixtral/; the shared pieces in
families/moe.py) against transformers' own Qwen3MoeForCausalLM and MixtralForCausalLM, built
tiny and random here (never from a hub), with more experts than top-k: logits and the training
loss with its router's loss at assert_close defaults in fp32 (norm_topk_prob both ways, dense
layers among the sparse), the grouped experts against the per-expert loop, the adapter an exact
inverse on both Hugging Face layouts (per expert, and transformers 5's fused gate_up_proj), the
validation loss free of the router's loss, and every MoE field refused by name where no family
expresses it."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from stoker.families import FAMILIES, UnsupportedArchitecture, spec_of
from stoker.families.moe import GroupedExperts, SparseMoE, load_balancing_loss

transformers = pytest.importorskip("transformers")

_SHAPE = dict(
    vocab_size=300,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def _hf(kind: str, **over):
    """A random transformers mixture, every parameter off its init (norms not ones)."""
    torch.manual_seed(0)
    if kind == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(
            **_SHAPE,
            intermediate_size=96,
            moe_intermediate_size=32,
            head_dim=16,
            num_experts=6,
            num_experts_per_tok=2,
            router_aux_loss_coef=0.05,
            **over,
        )
        model = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        cfg = transformers.MixtralConfig(
            **_SHAPE,
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            router_aux_loss_coef=0.05,
            **over,
        )
        model = transformers.MixtralForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def _ours(hf, state: dict | None = None, **over):
    family = hf.config.model_type
    section = FAMILIES[family]
    cfg = section.model_validate(
        {"family": family, "block_size": 32, **section.from_hf_config(hf.config.to_dict()), **over}
    )
    spec = spec_of(cfg)
    model = spec.build(cfg, hf.config.vocab_size, None)
    model.load_state_dict(spec.from_hf(cfg, state or hf.state_dict(), hf.config.vocab_size), strict=True)
    return model.eval(), cfg


_CASES = [
    ("qwen3_moe", {"norm_topk_prob": True, "mlp_only_layers": [1]}),
    ("qwen3_moe", {"norm_topk_prob": False, "decoder_sparse_step": 1}),
    ("mixtral", {}),
]


@pytest.mark.parametrize(("kind", "over"), _CASES)
def test_logits_and_the_training_loss_with_the_routers_loss_are_transformers(kind, over):
    hf = _hf(kind, **over)
    ours, cfg = _ours(hf)
    if over.get("mlp_only_layers"):  # a dense layer among the sparse ones
        assert cfg.sparse_layers() == [0, 2] and not ours.layers[1].sparse
    idx = torch.randint(0, 300, (2, 25), generator=torch.Generator().manual_seed(1))
    x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
    with torch.no_grad():
        torch.testing.assert_close(ours(x)[0], hf(x).logits)
    hf.train()
    ours.train()
    theirs = hf(x, labels=y, shift_labels=y, output_router_logits=True)
    _, loss = ours(x, y)
    torch.testing.assert_close(loss, theirs.loss)  # language model + router_aux_loss_coef x load balancing
    lm, aux = ours.last_losses
    torch.testing.assert_close(aux, theirs.aux_loss)
    assert cfg.aux_loss_coef == 0.05 and float(aux) > 0
    # the gradients flow into the routers through the load-balancing loss
    loss.backward()
    assert all(ours.layers[i].mlp.gate.weight.grad.abs().sum() > 0 for i in cfg.sparse_layers())


def test_in_evaluation_the_loss_is_the_language_models_alone():
    hf = _hf("qwen3_moe")
    ours, _ = _ours(hf)
    idx = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(2))
    x, y = idx[:, :-1], idx[:, 1:]
    with torch.no_grad():
        _, val = ours.eval()(x, y)
        independent = F.cross_entropy(hf(x).logits.reshape(-1, 300), y.reshape(-1))
        torch.testing.assert_close(val, independent)
        _, trained = ours.train()(x, y)
    assert float(trained) > float(val)  # the router's loss is added in training only


def test_the_grouped_experts_equal_the_loop_forward_and_backward():
    torch.manual_seed(3)
    moe = SparseMoE(32, 24, num_experts=5, top_k=2, norm_topk_prob=True)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    loop = SparseMoE(32, 24, num_experts=5, top_k=2, norm_topk_prob=True, impl="loop")
    loop.load_state_dict(moe.state_dict())
    x = torch.randn(3, 7, 32)
    outs, grads = [], []
    for m in (moe, loop):
        xi = x.clone().requires_grad_(True)
        y, stats = m(xi)
        (y.square().sum() + stats[1].sum()).backward()
        outs.append(y)
        grads.append([xi.grad] + [p.grad for p in m.parameters()])
    torch.testing.assert_close(outs[0], outs[1])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)
    # CUDA's padded groups (each expert's rows rounded up to 16) give the same rows
    e = moe.experts
    xs = torch.randn(11, 32)
    counts = torch.tensor([3, 0, 5, 1, 2])
    torch.testing.assert_close(
        GroupedExperts._grouped(xs, counts, e.gate_proj, e.up_proj, e.down_proj, align=16),
        GroupedExperts._loop(xs, counts, e.gate_proj, e.up_proj, e.down_proj),
    )


def test_load_balancing_is_over_every_sparse_layers_tokens_at_once():
    """transformers' rule: the assignment share and the mean probability each over all layers'
    tokens, then multiplied: not the mean of per-layer losses."""
    probs = [torch.softmax(torch.randn(10, 4, generator=torch.Generator().manual_seed(i)), -1) for i in range(2)]
    stats = []
    for p in probs:
        top = p.topk(2, dim=-1).indices
        stats.append(torch.stack([torch.bincount(top.reshape(-1), minlength=4).float(), p.sum(0)]))
    expected = transformers.models.mixtral.modeling_mixtral.load_balancing_loss_func(
        tuple(torch.log(p) for p in probs), 4, 2
    )
    torch.testing.assert_close(load_balancing_loss(stats, 10, 2), expected)


@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_the_adapter_is_an_exact_inverse_on_both_layouts_of_the_files(kind, tmp_path):
    """A base saved by transformers 5 (one tensor per expert on disk) and one saved in its own
    fused layout (save_original_format=False) load, slice by slice, into the same weights; the
    export unstacks them to the per-expert files transformers reads back to equal tensors."""
    from safetensors import safe_open

    from stoker.training.base import load_base

    hf = _hf(kind)
    hf.save_pretrained(tmp_path / "per-expert")
    hf.save_pretrained(tmp_path / "fused", save_original_format=False)
    names = {}
    for layout in ("per-expert", "fused"):
        with safe_open(str(tmp_path / layout / "model.safetensors"), "pt") as f:
            names[layout] = set(f.keys())
    assert any(".experts.0." in n for n in names["per-expert"]) and not any(".experts.0." in n for n in names["fused"])
    _, cfg = _ours(hf)
    spec = spec_of(cfg)
    loaded = []
    for layout in ("per-expert", "fused"):
        model = spec.build(cfg, 300, None)
        load_base(model, cfg, str(tmp_path / layout))
        loaded.append(model.state_dict())
    assert all(torch.equal(loaded[0][k], loaded[1][k]) for k in loaded[0])
    with safe_open(str(tmp_path / "per-expert" / "model.safetensors"), "pt") as f:
        on_disk = {k: f.get_tensor(k) for k in f.keys()}
    out = spec.to_hf(cfg, loaded[0], 300)
    assert out.keys() == on_disk.keys() and all(torch.equal(out[k], on_disk[k]) for k in out)
    # its config.json is the family's, and transformers reads it back to the same fields
    written = type(hf.config)(**cfg.to_hf_config(300))
    assert FAMILIES[kind].from_hf_config(written.to_dict()) == FAMILIES[kind].from_hf_config(hf.config.to_dict())
    on_disk_config = json.loads((tmp_path / "per-expert" / "config.json").read_text())
    assert FAMILIES[kind].from_hf_config(on_disk_config) == FAMILIES[kind].from_hf_config(hf.config.to_dict())


def test_the_plan_counts_total_and_active_parameters_and_flops_of_the_active():
    hf = _hf("qwen3_moe", mlp_only_layers=[1])
    ours, cfg = _ours(hf)
    shape = cfg.plan_shape(300)
    total = sum(p.numel() for p in ours.parameters())
    assert shape["layers"] * shape["block_params"] + shape["root_params"] >= total  # the mean block rounded up
    assert shape["layers"] * shape["block_params"] + shape["root_params"] - total < shape["layers"]
    assert shape["active_params"] == ours.num_active_params()
    attention = 12 * 3 * 4 * 16 * 32
    assert ours.flops_per_token() == 6 * ours.num_active_params() + attention


@pytest.mark.parametrize(
    ("kind", "field", "value", "said"),
    [
        ("qwen3_moe", "shared_expert_intermediate_size", 64, "a shared expert"),
        ("qwen3_moe", "scoring_func", "sigmoid", "scoring function"),
        ("qwen3_moe", "topk_method", "group_limited_greedy", "grouped top-k"),
        ("mixtral", "router_jitter_noise", 0.1, "jitter"),
        ("mixtral", "attention_bias", True, "attention biases"),
    ],
)
def test_a_mixture_field_no_family_expresses_is_refused_by_name(kind, field, value, said):
    config = {**_hf(kind).config.to_dict(), field: value}
    with pytest.raises(UnsupportedArchitecture, match=said):
        FAMILIES[kind].from_hf_config(config)


def test_a_dense_config_json_is_refused_by_the_moe_families_and_a_mixture_by_the_dense_ones():
    dense = transformers.Qwen3Config(**_SHAPE, intermediate_size=96, head_dim=16).to_dict()
    with pytest.raises(UnsupportedArchitecture):
        FAMILIES["qwen3_moe"].from_hf_config(dense)
    with pytest.raises(UnsupportedArchitecture, match="a mixture of experts"):
        FAMILIES["llama"].from_hf_config({**_hf("mixtral").config.to_dict(), "model_type": "mistral"})


def test_an_expert_idle_for_many_steps_is_told_once_per_layer_and_the_load_as_shares():
    from stoker.contracts import events
    from stoker.families.moe import RouterLoad

    router = RouterLoad([0, 2], 4, warn_steps=10)
    counts = torch.tensor([[1.0, 0.0, 3.0, 4.0], [2.0, 2.0, 2.0, 2.0]])
    assert router.step(counts, 5) == []
    assert router.step(counts, 5) == [(0, [1], 10)]  # expert 1 of layer 0: 10 steps without a token
    assert router.step(counts, 5) == []  # said once per layer
    assert router.shares(counts) == {"layers": [0, 2], "busiest": [0.5, 0.25], "idlest": [0.0, 0.25]}
    said = events.IdleExperts(step=15, layer=0, experts=[1], steps=10)
    assert events.decode(said.encode()) == said  # the launcher reads it back (and warns)
