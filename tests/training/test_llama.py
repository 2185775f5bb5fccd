"""The llama family (stoker.families.llama.model) against transformers' own models, built tiny
and random here (never from a hub): Llama 3.2 (grouped-query attention, llama3 RoPE scaling,
tied embeddings), Qwen2 (q/k/v biases, untied) and Mistral (untied). A base's weights give
transformers' logits in fp32 (so the RoPE layout, the norms and the biases are exact), the
adapter is an exact inverse in both directions, a meta-device build is a direct build, and the
chunked loss and activation checkpointing change no loss or gradient."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from stoker.families import build_model, spec_of
from stoker.families.layers import checkpoint_blocks
from stoker.families.llama.config import LlamaConfig
from stoker.families.llama.model import SPEC, Llama

transformers = pytest.importorskip("transformers")

_SHAPE = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    vocab_size=300,
    max_position_embeddings=64,
)
# rope_theta and rope_scaling as transformers 4 spells them (transformers 5 reads them into
# rope_parameters). The llama3 scaling's original context is 16, so it changes the frequencies
# that matter at 24 tokens.
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
STYLES = {
    "llama3.2": lambda: transformers.LlamaConfig(
        **_SHAPE, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE, rms_norm_eps=1e-5, tie_word_embeddings=True
    ),
    "qwen2": lambda: transformers.Qwen2Config(
        **_SHAPE, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False
    ),
    "mistral": lambda: transformers.MistralConfig(
        **_SHAPE, rope_theta=1e4, rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None
    ),
}


def _hf_model(style: str, configs: dict | None = None):
    """A random transformers model of a style (of `configs`, STYLES by default), every parameter
    off its init (norm gains not ones, biases not zeros), fp32, eval mode."""
    torch.manual_seed(0)
    hf_cfg = (configs or STYLES)[style]()
    hf_cfg._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * (0.2 if p.dim() == 1 else 0.02))
    return model


def _our_cfg(hf_model, block_size: int = 32) -> LlamaConfig:
    fields = LlamaConfig.from_hf_config(hf_model.config.to_dict())
    return LlamaConfig.model_validate({"family": "llama", "block_size": block_size, **fields})


def _stored(hf_model, cfg: LlamaConfig) -> dict[str, torch.Tensor]:
    """The tensors a saved base holds: a tied output matrix is left out (save_pretrained)."""
    return {k: v for k, v in hf_model.state_dict().items() if k not in SPEC.hf_tied(cfg)}


def _ids(vocab: int, shape=(2, 24), seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _from_base(hf_model, vocab_size: int) -> tuple[Llama, LlamaConfig]:
    cfg = _our_cfg(hf_model)
    ours = Llama(cfg, vocab_size, seed=None)
    ours.load_state_dict(SPEC.from_hf(cfg, _stored(hf_model, cfg), vocab_size), strict=True)
    return ours.eval(), cfg


@pytest.mark.parametrize("style", list(STYLES))
def test_config_of_each_style(style):
    cfg = _our_cfg(_hf_model(style))
    expected = {
        "llama3.2": dict(rope_type="llama3", rope_factor=32.0, rope_original_context=16, qkv_bias=False),
        "qwen2": dict(rope_type="default", rope_theta=1e6, qkv_bias=True, tie_embeddings=False),
        "mistral": dict(rope_type="default", rope_theta=1e4, qkv_bias=False, tie_embeddings=False),
    }[style]
    assert {k: getattr(cfg, k) for k in expected} == expected
    assert (cfg.n_kv_head, cfg.resolved_head_dim, cfg.vocab_size) == (2, 16, 300)
    assert spec_of(cfg) is SPEC


@pytest.mark.parametrize("style", list(STYLES))
def test_a_base_gives_transformers_logits(style):
    hf = _hf_model(style)
    vocab = 290  # a tokenizer with fewer ids than the base's 300 rows: its logits are the first 290
    ours, cfg = _from_base(hf, vocab)
    assert ours.embed_tokens.weight.shape[0] == 300
    assert (ours.lm_head.weight is ours.embed_tokens.weight) == (style == "llama3.2")
    idx = _ids(vocab)
    with torch.no_grad():
        logits, loss = ours(idx)
        expected = hf(idx).logits
    assert loss is None and logits.shape == (2, 24, vocab)
    torch.testing.assert_close(logits, expected[..., :vocab])
    rotary = getattr(hf.model, "rotary_emb", None)  # one per model since transformers 4.45
    if rotary is not None:  # the same RoPE tables, bit for bit
        cos, sin = rotary(torch.zeros(1), torch.arange(cfg.block_size)[None])
        assert torch.equal(cos[0], ours.rope.cos) and torch.equal(sin[0], ours.rope.sin)


@pytest.mark.parametrize("style", list(STYLES))
def test_the_adapter_is_an_exact_inverse(style):
    hf = _hf_model(style)
    cfg = _our_cfg(hf)
    stored = _stored(hf, cfg)
    ours = SPEC.from_hf(cfg, stored, 300)
    assert set(ours) == set(Llama(cfg, 300, seed=None).state_dict())
    back = SPEC.to_hf(cfg, ours, 300)
    assert set(back) == set(stored)
    assert all(torch.equal(back[k], stored[k]) for k in stored), [
        k for k in stored if not torch.equal(back[k], stored[k])
    ]


def _our_llama32(**extra) -> LlamaConfig:
    """A Llama 3.2 of our own (no base): the test styles' shape, llama3 RoPE."""
    return LlamaConfig.model_validate(
        {
            "family": "llama",
            "block_size": 32,
            "n_layer": 2,
            "n_head": 4,
            "n_kv_head": 2,
            "n_embd": 64,
            "intermediate_size": 96,
            "rope_type": "llama3",
            "rope_factor": 32.0,
            "rope_low_freq_factor": 1.0,
            "rope_high_freq_factor": 4.0,
            "rope_original_context": 16,
            "norm_eps": 1e-5,
            **extra,
        }
    )


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_our_weights_give_our_logits_in_transformers(qkv_bias):
    """Random stoker weights (a padded vocabulary: 300 ids in 384 rows) exported to the HF
    config stoker writes load strictly into transformers and give our logits."""
    vocab = 300
    cfg = _our_llama32(qkv_bias=qkv_bias, tie_embeddings=not qkv_bias)
    ours = Llama(cfg, vocab, seed=3).eval()
    with torch.no_grad():  # norms and biases off their init
        for p in ours.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
    assert ours.embed_tokens.weight.shape[0] == 384
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf_config(vocab))
    hf_cfg._attn_implementation = "eager"
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg).float().eval()
    result = hf.load_state_dict(SPEC.to_hf(cfg, ours.state_dict(), vocab), strict=False)
    assert list(result.unexpected_keys) == []
    assert list(result.missing_keys) == (["lm_head.weight"] if cfg.tie_embeddings else [])
    if cfg.tie_embeddings:
        assert hf.lm_head.weight is hf.model.embed_tokens.weight
    idx = _ids(vocab)
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0], hf(idx).logits)


@pytest.mark.parametrize("tied", [True, False])
def test_a_meta_build_is_a_direct_build(tied):
    cfg = _our_llama32(tie_embeddings=tied, qkv_bias=not tied)
    direct = build_model(cfg, 300, seed=7)
    with torch.device("meta"):
        meta = SPEC.build(cfg, 300, None)
    meta.to_empty(device="cpu")
    SPEC.init_weights(meta, 7)
    assert (meta.lm_head.weight is meta.embed_tokens.weight) == tied
    a, b = direct.state_dict(), meta.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert not any("rope" in k or "cos" in k for k in a)  # the RoPE tables are no state
    assert len(SPEC.blocks(meta)) == 2
    idx = _ids(300, seed=2)
    with torch.no_grad():
        assert torch.equal(direct(idx)[0], meta(idx)[0])


def test_an_fsdp2_sharded_build_is_a_direct_build():
    """As the engine builds under FSDP2 (a gloo group of one rank, in this process): meta,
    fully_shard per block and the root, to_empty, init_weights: DTensor parameters of the
    direct build's values, the output matrix still tied, the same loss and gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    cfg = _our_llama32()
    direct = SPEC.build(cfg, 300, 5)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with torch.device("meta"):
            sharded = SPEC.build(cfg, 300, None)
        mesh = init_device_mesh("cpu", (1,))
        for block in SPEC.blocks(sharded):
            fully_shard(block, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        sharded.to_empty(device="cpu")
        SPEC.init_weights(sharded, 5)
        assert sharded.lm_head.weight is sharded.embed_tokens.weight
        for name, p in sharded.named_parameters():
            assert hasattr(p, "device_mesh") and torch.equal(p.full_tensor(), direct.get_parameter(name)), name
        idx, targets = _ids(300, seed=4), _ids(300, seed=5)
        loss, grads = _loss_and_grads(sharded, idx, targets)
        direct_loss, direct_grads = _loss_and_grads(direct, idx, targets)
        torch.testing.assert_close(loss, direct_loss)
        for name, g in grads.items():
            torch.testing.assert_close(g.full_tensor(), direct_grads[name], msg=name)
    finally:
        dist.destroy_process_group()


def test_init_is_per_name_and_seed():
    cfg = _our_llama32(qkv_bias=True)
    m = Llama(cfg, 300, seed=0)
    sd = m.state_dict()
    assert torch.equal(sd["norm.weight"], torch.ones(64))
    assert torch.equal(sd["layers.1.self_attn.k_proj.bias"], torch.zeros(32))
    assert sd["layers.0.self_attn.o_proj.weight"].std() < 0.6 * sd["layers.0.self_attn.q_proj.weight"].std()
    assert not torch.equal(sd["layers.0.mlp.up_proj.weight"], sd["layers.1.mlp.up_proj.weight"])
    assert not torch.equal(sd["embed_tokens.weight"], Llama(cfg, 300, seed=1).state_dict()["embed_tokens.weight"])


def test_flops_count_the_tied_matrix_once():
    tied = Llama(_our_llama32(), 300, seed=0)
    untied = Llama(_our_llama32(tie_embeddings=False), 300, seed=0)
    rows_x_width = 384 * 64
    assert untied.num_params(embedding=True) == tied.num_params() + rows_x_width
    assert untied.num_params() == tied.num_params()  # the input lookup is no matmul
    assert SPEC.flops_per_token(tied) == 6 * tied.num_params() + 12 * 2 * 4 * 16 * 32


def _loss_and_grads(model: Llama, idx, targets):
    model.zero_grad(set_to_none=True)
    _, loss = model(idx, targets)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_the_loss_full_and_chunked():
    cfg = _our_llama32(dropout=0.0)
    m = Llama(cfg, 300, seed=0)
    idx, targets = _ids(300, seed=4), _ids(300, seed=5)
    logits, loss = m(idx, targets)  # full logits, padded rows included (never a target)
    assert logits.shape == (2, 24, 384)
    torch.testing.assert_close(loss, F.cross_entropy(logits.reshape(-1, 384), targets.reshape(-1)))
    full, full_grads = _loss_and_grads(m, idx, targets)
    m.loss_chunk = 5  # 48 tokens: 9 chunks of 5 and one of 3
    chunked, chunked_grads = _loss_and_grads(m, idx, targets)
    assert m(idx, targets)[0] is None
    torch.testing.assert_close(chunked, full)
    for name, g in full_grads.items():
        torch.testing.assert_close(chunked_grads[name], g, msg=name)


def test_activation_checkpointing_changes_no_loss_or_gradient():
    m = Llama(_our_llama32(qkv_bias=True), 300, seed=0).train()
    idx, targets = _ids(300, seed=4), _ids(300, seed=5)
    base_loss, base_grads = _loss_and_grads(m, idx, targets)
    for mode in ("selective", "full"):
        m = Llama(_our_llama32(qkv_bias=True), 300, seed=0).train()
        checkpoint_blocks(m.layers, mode)
        loss, grads = _loss_and_grads(m, idx, targets)
        torch.testing.assert_close(loss, base_loss)
        for name, g in base_grads.items():
            torch.testing.assert_close(grads[name], g, msg=f"{mode}: {name}")


def test_a_longer_sequence_than_the_context_is_refused():
    m = Llama(_our_llama32(), 300, seed=0)
    with pytest.raises(ValueError, match="longer than the context"):
        m(_ids(300, shape=(1, 33)))
