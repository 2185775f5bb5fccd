"""The qwen3_moe family's module: the mixtral family's mixture model (sparse blocks, the
router's loss in training only, the router's load) with Qwen3's attention (q/k RMSNorm per
head) and dense layers where ``mlp_only_layers`` / ``decoder_sparse_step`` say; its Hugging
Face adapter (Qwen3MoeForCausalLM: ``mlp.gate.weight`` the router,
``mlp.experts.{e}.gate_proj/up_proj/down_proj.weight`` stacked, or transformers 5's fused
``mlp.experts.gate_up_proj`` where a checkpoint holds it)."""

from __future__ import annotations

from stoker.families.llama import model as llama
from stoker.families.mixtral import model as mixtral
from stoker.families.qwen3 import model as qwen3
from stoker.families.qwen3_moe.config import Qwen3MoeConfig
from stoker.families.spec import ModelSpec


class Qwen3Moe(mixtral.Mixtral):
    ATTENTION = qwen3.Attention


def hf_map(cfg: Qwen3MoeConfig):
    return mixtral.moe_hf_map(cfg, "mlp", ("gate_proj", "up_proj", "down_proj"), qwen3.QK_NORMS)


SPEC = ModelSpec(
    family="qwen3_moe",
    build=lambda cfg, vocab_size, seed: Qwen3Moe(cfg, vocab_size, seed=seed),
    blocks=lambda model: list(model.layers),
    init_weights=mixtral.init_weights,
    flops_per_token=lambda model: model.flops_per_token(),
    vocab_rows=llama.vocab_rows,
    hf_map=hf_map,
    hf_tied=llama.hf_tied,
    hf_fused=mixtral.moe_hf_fused,
    moe=True,
)
