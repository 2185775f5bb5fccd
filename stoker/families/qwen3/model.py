"""The qwen3 family's module: the llama family's with Qwen3's attention, which normalizes q
and k per head (an RMSNorm of head_dim, before RoPE) as transformers' ``Qwen3Attention`` does,
op for op; its Hugging Face adapter (Qwen3ForCausalLM: llama's names plus
``self_attn.q_norm.weight`` and ``self_attn.k_norm.weight``); its tensor-parallel plan
(``parallel.py``). Initial values as the llama family's (the norms' gains are ones)."""

from __future__ import annotations

import torch

from stoker.families.common import RMSNorm
from stoker.families.llama import model as llama
from stoker.families.qwen3 import parallel
from stoker.families.qwen3.config import Qwen3Config
from stoker.families.spec import ModelSpec

QK_NORMS = ("self_attn.q_norm.weight", "self_attn.k_norm.weight")


class Attention(llama.Attention):
    """Grouped-query attention with rotary positions, q and k RMSNorm'd per head."""

    def __init__(self, cfg: Qwen3Config):
        super().__init__(cfg)
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().heads(x)  # (B, T, heads, hd)
        return self.q_norm(q), self.k_norm(k), v


class Qwen3(llama.Llama):
    ATTENTION = Attention


def hf_map(cfg: Qwen3Config) -> list[tuple[str, str, bool]]:
    return llama.hf_map(cfg, QK_NORMS)


SPEC = ModelSpec(
    family="qwen3",
    build=lambda cfg, vocab_size, seed: Qwen3(cfg, vocab_size, seed=seed),
    blocks=lambda model: list(model.layers),
    init_weights=lambda model, seed: llama.init_weights(model, seed),
    flops_per_token=lambda model: model.flops_per_token(),
    vocab_rows=llama.vocab_rows,
    hf_map=hf_map,
    hf_tied=llama.hf_tied,
    parallelize=lambda model, tp_mesh: parallel.parallelize(model, tp_mesh),
)
