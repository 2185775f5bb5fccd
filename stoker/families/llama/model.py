"""The llama family: Llama 2/3/3.1/3.2, Mistral and Qwen2/2.5 (pre-norm blocks of RMSNorm,
rotary positions, grouped-query attention and a SwiGLU MLP), its spec and its Hugging Face
adapter (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM).

The parameters carry transformers' names (less the ``model.`` prefix), so the adapter is a
plain rename with no transposes, and RoPE uses transformers' rotate_half layout, so the q/k
projections of a Hugging Face checkpoint load as they are (no permutation). Attention is
``scaled_dot_product_attention`` with ``enable_gqa`` (the key/value heads are never repeated in
memory), within documents under model.attention 'document' (``attention.attend``). The embedding rows are a base's own count (``model.vocab_size``) or the tokenizer's
padded to ``model.vocab_pad_multiple``. Initial weights are a pure function of the seed and each
parameter's name, as in the gpt2 family, so a meta-device build sharded by FSDP2 starts from the
same values as a replicated one.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from stoker.families.attention import attend, attention_mask
from stoker.families.common import (
    RMSNorm,
    Rotary,
    SwiGLU,
    apply_rope,
    copy_full_value,
    rope_inv_freq,
    seeded_generator,
)
from stoker.families.layers import chunked_cross_entropy, logits_and_loss, padded_vocab
from stoker.families.llama import parallel
from stoker.families.llama.config import LlamaConfig
from stoker.families.spec import ModelSpec


class Attention(nn.Module):
    """Causal self-attention with rotary positions and n_kv_head key/value heads shared by
    groups of the n_head query heads."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.n_kv_head, cfg.resolved_head_dim
        self.dropout = cfg.dropout
        C, hd = cfg.n_embd, self.head_dim
        self.q_proj = nn.Linear(C, self.n_head * hd, bias=bool(cfg.qkv_bias))
        self.k_proj = nn.Linear(C, self.n_kv_head * hd, bias=bool(cfg.qkv_bias))
        self.v_proj = nn.Linear(C, self.n_kv_head * hd, bias=bool(cfg.qkv_bias))
        self.o_proj = nn.Linear(self.n_head * hd, C, bias=False)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k and v by heads, (B, T, heads, hd) each: where a family built on this one (qwen3)
        normalizes q and k per head."""
        B, T, _ = x.shape
        hd = self.head_dim
        # -1 heads: under tensor parallel (parallel.py) a rank holds n_head / tp_degree query
        # heads and n_kv_head / tp_degree key/value heads, the same groups
        return self.q_proj(x).view(B, T, -1, hd), self.k_proj(x).view(B, T, -1, hd), self.v_proj(x).view(B, T, -1, hd)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = (t.transpose(1, 2) for t in self.heads(x))  # (B, nh, T, hd), 2 x (B, nkv, T, hd)
        q, k = apply_rope(q, k, cos, sin)
        dropout = self.dropout if self.training else 0.0
        y = attend(q, k, v, mask, dropout, self.n_kv_head != self.n_head)  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, -1)  # (B, T, nh*hd)
        return self.resid_dropout(self.o_proj(y))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig, attention: type[Attention] = Attention):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.self_attn = attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.n_embd, cfg.intermediate_size, cfg.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)  # (B, T, C)
        return x + self.mlp(self.post_attention_layernorm(x))


def vocab_rows(cfg: LlamaConfig, vocab_size: int) -> int:
    """The embedding rows: a base's own count, else the tokenizer's padded."""
    return cfg.vocab_size or padded_vocab(vocab_size, cfg.vocab_pad_multiple)


def _inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    return rope_inv_freq(
        cfg.resolved_head_dim,
        cfg.rope_theta,
        cfg.rope_type or "default",
        factor=cfg.rope_factor,
        low_freq_factor=cfg.rope_low_freq_factor,
        high_freq_factor=cfg.rope_high_freq_factor,
        original_context=cfg.rope_original_context,
    )


class Llama(nn.Module):
    ATTENTION: type[Attention] = Attention  # a family built on this one (qwen3) gives its own

    def __init__(self, cfg: LlamaConfig, vocab_size: int, *, seed: int | None = 0):
        """vocab_size: the tokenizer's; seed=None leaves the weights uninitialized (a
        meta-device build; see init_weights)."""
        super().__init__()
        self.cfg, self.vocab_size = cfg, vocab_size
        self.loss_chunk = 0  # tokens per chunk of a chunked cross-entropy; 0: the full logits
        self.document_end_id: int | None = None  # the separator of model.attention 'document'
        rows = vocab_rows(cfg, vocab_size)
        if rows < vocab_size:
            raise ValueError(f"model.vocab_size {rows} is below the tokenizer's {vocab_size} ids")
        self.embed_tokens = nn.Embedding(rows, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(self.block(cfg, i) for i in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.n_embd, rows, bias=False)
        self.rope = Rotary(_inv_freq(cfg), cfg.block_size)  # no parameters, no state
        self._tie()
        # the output layer and loss; the engine swaps in a compiled one under FSDP2
        self.output_loss = logits_and_loss
        if seed is not None:
            init_weights(self, seed)

    def block(self, cfg: LlamaConfig, index: int) -> nn.Module:
        """Block ``index`` of the model: where a family built on this one (mixtral) puts its own."""
        return Block(cfg, self.ATTENTION)

    def _tie(self) -> None:
        # a meta-device build's to_empty (without FSDP2) gives each module a new parameter,
        # so init_weights ties them again
        if self.cfg.tie_embeddings and self.lm_head.weight is not self.embed_tokens.weight:
            self.lm_head.weight = self.embed_tokens.weight

    def num_params(self, embedding: bool = False) -> int:
        """Parameters (a tied output matrix once); without an untied input embedding (a
        lookup, no matmul) unless asked."""
        n = sum(p.numel() for p in self.parameters())
        if embedding or self.lm_head.weight is self.embed_tokens.weight:
            return n
        return n - self.embed_tokens.weight.numel()

    def flops_per_token(self) -> float:
        """Training FLOPs per token, as the plan counts them (the section's ``flops_per_token``:
        6N + 12·L·H·hd·T, H·hd the query width, N without an untied input embedding)."""
        return self.cfg.flops_per_token(self.embed_tokens.weight.shape[0])

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        return self.head(self.trunk(idx), targets)

    def trunk(self, idx: torch.Tensor) -> torch.Tensor:
        """The blocks and the final norm: (B, T) ids -> (B, T, C)."""
        B, T = idx.shape
        cos, sin = self.rope(T)  # 2 x (T, hd), fp32
        mask = attention_mask(self, idx)  # None: causal; once per micro-batch for every block
        x = self.drop(self.embed_tokens(idx))  # (B, T, C)
        for block in self.layers:
            x = block(x, cos, sin) if mask is None else block(x, cos, sin, mask)
        return self.norm(x)  # (B, T, C)

    def head(self, h: torch.Tensor, targets: torch.Tensor | None):
        """The output layer: (logits, None) without targets; with them (logits or None, the
        mean cross-entropy)."""
        B, T, _ = h.shape
        if targets is not None and self.loss_chunk:  # the full logits never exist
            return None, chunked_cross_entropy(
                h.view(B * T, -1), self.lm_head.weight, targets.reshape(-1), self.loss_chunk
            )
        if targets is None:
            return self.lm_head(h)[..., : self.vocab_size], None  # (B, T, V)
        return self.output_loss(h, self.lm_head.weight, targets)


_OUTPUT_PROJECTIONS = ("o_proj.weight", "down_proj.weight", "experts.down_proj")  # a mixture's stacked experts too


def _init_value(name: str, shape: torch.Size, n_layer: int, seed: int) -> torch.Tensor:
    """The initial value of one parameter, from a generator of (seed, name) alone: RMSNorm
    gains ones, biases zeros, the rest normal(0, 0.02), the projections into the residual
    stream scaled by 1/sqrt(2·n_layer) (GPT-2's scaled init)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    std = 0.02 / math.sqrt(2 * n_layer) if name.endswith(_OUTPUT_PROJECTIONS) else 0.02
    return torch.empty(shape).normal_(0.0, std, generator=seeded_generator(seed, name))


@torch.no_grad()
def init_weights(model: Llama, seed: int) -> None:
    """Set every parameter to its initial value and (re)compute the RoPE tables on the
    model's device. Works on plain and FSDP2-sharded (DTensor) parameters alike: each rank
    fills only its own shard, with no communication."""
    if not hasattr(model.embed_tokens.weight, "device_mesh"):  # FSDP2 keeps a tie itself
        model._tie()
    for name, p in model.named_parameters():
        copy_full_value(p, _init_value(name, p.shape, model.cfg.n_layer, seed))
    model.rope.reset(model.embed_tokens.weight.device)


# ---- the Hugging Face adapter (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM) -------
# The same names under model. (and lm_head.weight), the same layouts: nothing is transposed. A
# tied output matrix is not stored (transformers' save_pretrained leaves lm_head.weight out).
_BLOCK_PARAMS = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)
_QKV_BIASES = ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias")


def hf_map(cfg: LlamaConfig, extra_block_params: tuple[str, ...] = ()) -> list[tuple[str, str, bool]]:
    """Every tensor of ours with its Hugging Face name (never transposed); a family built on
    this one names the tensors its blocks add (qwen3's q and k norms)."""
    names = _BLOCK_PARAMS + (_QKV_BIASES if cfg.qkv_bias else ()) + extra_block_params
    out = [("embed_tokens.weight", "model.embed_tokens.weight", False)]
    for i in range(cfg.n_layer):
        out += [(f"layers.{i}.{n}", f"model.layers.{i}.{n}", False) for n in names]
    out.append(("norm.weight", "model.norm.weight", False))
    if not cfg.tie_embeddings:
        out.append(("lm_head.weight", "lm_head.weight", False))
    return out


def hf_tied(cfg: LlamaConfig) -> dict[str, str]:
    """The output matrix when tied: the embedding's HF tensor."""
    return {"lm_head.weight": "model.embed_tokens.weight"} if cfg.tie_embeddings else {}


SPEC = ModelSpec(
    family="llama",
    build=lambda cfg, vocab_size, seed: Llama(cfg, vocab_size, seed=seed),
    blocks=lambda model: list(model.layers),
    init_weights=lambda model, seed: init_weights(model, seed),
    flops_per_token=lambda model: model.flops_per_token(),
    vocab_rows=vocab_rows,
    hf_map=hf_map,
    hf_tied=hf_tied,
    parallelize=lambda model, tp_mesh: parallel.parallelize(model, tp_mesh),
)
