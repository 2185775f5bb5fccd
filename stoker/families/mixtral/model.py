"""The mixtral family's module: the llama family's with each sparse layer's MLP a mixture of
experts (``families.moe.SparseMoE``), and what every mixture's model does beyond a dense one
(a family built on this one, qwen3_moe, takes it whole):

- each block returns (x, the router's statistics of its layer, or None for a dense layer);
- in training, with targets, the loss is the language-model loss plus ``router_aux_loss_coef``
  x the load-balancing loss over every sparse layer (transformers' ``loss + coef * aux_loss``
  with ``output_router_logits``); in evaluation (``model.eval()``) and without targets, the
  language-model loss alone: no validation loss, bits per byte or score ever holds the
  router's loss;
- the assignments per expert of each sparse layer are summed over the training forwards since
  the trainer last read them (``take_router_load``), for the router's balance shown at each log
  step; ``last_losses`` holds the latest training forward's (language-model, load-balancing)
  losses.

Its Hugging Face adapter stacks the per-expert tensors of a base
(``block_sparse_moe.experts.{e}.w1/w3/w2.weight``: gate, up, down) into the experts' (E, F, D)
and (E, D, F) weights and unstacks them on export (``ModelSpec.hf_map`` entries whose Hugging
Face side is a tuple of names, one per expert).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from stoker.families.common import RMSNorm, SwiGLU
from stoker.families.llama import model as llama
from stoker.families.mixtral.config import MixtralConfig
from stoker.families.moe import SparseMoE, load_balancing_loss
from stoker.families.spec import ModelSpec


class MoeBlock(nn.Module):
    """A pre-norm block whose MLP is sparse (SparseMoE) or dense (SwiGLU)."""

    def __init__(self, cfg, attention: type[llama.Attention], sparse: bool):
        super().__init__()
        self.sparse = sparse
        self.input_layernorm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.self_attn = attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        if sparse:
            self.mlp = SparseMoE(
                cfg.n_embd,
                cfg.expert_width,
                cfg.num_experts,
                cfg.num_experts_per_tok,
                norm_topk_prob=norm_topk(cfg),
                impl=cfg.experts_impl,
            )
        else:
            self.mlp = SwiGLU(cfg.n_embd, cfg.intermediate_size, cfg.dropout)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask)  # (B, T, C)
        h = self.post_attention_layernorm(x)
        if not self.sparse:
            return x + self.mlp(h), None
        y, stats = self.mlp(h)
        return x + y, stats


def norm_topk(cfg) -> bool:
    """Mixtral always renormalizes the top-k weights; qwen3_moe as norm_topk_prob says."""
    value = getattr(cfg, "norm_topk_prob", None)
    return True if value is None else bool(value)


class Mixtral(llama.Llama):
    """The llama family's model with sparse layers (see the module docstring)."""

    def __init__(self, cfg, vocab_size: int, *, seed: int | None = 0):
        self._sparse = set(cfg.sparse_layers())
        super().__init__(cfg, vocab_size, seed=seed)
        # made at the first training forward, on its device (no buffer: a meta-device build's
        # to_empty would leave it uninitialized, and a checkpoint has no business with it)
        self.router_load: torch.Tensor | None = None
        self.last_losses: tuple[torch.Tensor, torch.Tensor] | None = None

    def block(self, cfg, index: int) -> nn.Module:
        return MoeBlock(cfg, self.ATTENTION, index in self._sparse)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        B, T = idx.shape
        h, stats = self.trunk_with_router(idx)
        logits, loss = self.head(h, targets)
        if targets is None or not self.training or not stats:
            return logits, loss
        with torch.no_grad():
            counts = torch.stack([s[0] for s in stats])
            self.router_load = counts if self.router_load is None else self.router_load + counts
        aux = load_balancing_loss(stats, B * T, self.cfg.num_experts_per_tok)
        self.last_losses = (loss.detach(), aux.detach())
        coef = self.cfg.aux_loss_coef
        return logits, (loss + coef * aux.to(loss.dtype)) if coef else loss

    def trunk_with_router(self, idx: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        B, T = idx.shape
        cos, sin = self.rope(T)
        mask = llama.attention_mask(self, idx)
        x = self.drop(self.embed_tokens(idx))
        stats = []
        for block in self.layers:
            x, s = block(x, cos, sin) if mask is None else block(x, cos, sin, mask)
            if s is not None:
                stats.append(s)
        return self.norm(x), stats

    def trunk(self, idx: torch.Tensor) -> torch.Tensor:
        return self.trunk_with_router(idx)[0]

    def take_router_load(self) -> torch.Tensor:
        """(sparse layers, E) assignments per expert summed since the last call; reset."""
        load = self.router_load
        self.router_load = None
        if load is None:
            return torch.zeros(len(self._sparse), self.cfg.num_experts, device=self.embed_tokens.weight.device)
        return load

    def num_active_params(self) -> int:
        """Parameters a token runs: every parameter but the experts it is not routed to."""
        cfg = self.cfg
        idle = len(self._sparse) * (cfg.num_experts - cfg.num_experts_per_tok) * 3 * cfg.n_embd * cfg.expert_width
        return self.num_params() - idle


# ---- the seeded init: the experts' down projections scaled as the dense ones -----------------
def init_weights(model: Mixtral, seed: int) -> None:
    llama.init_weights(model, seed)


def vocab_rows(cfg, vocab_size: int) -> int:
    return llama.vocab_rows(cfg, vocab_size)


# ---- the Hugging Face adapter (MixtralForCausalLM) ----------------------------------------------
_ATTENTION = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
)
_DENSE = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")


def moe_hf_map(cfg, moe_prefix: str, expert_names: tuple[str, str, str], extra_attention: tuple[str, ...] = ()):
    """Every tensor of ours with its Hugging Face name(s): a stacked expert weight with the
    tuple of its E per-expert tensors (``{moe_prefix}.experts.{e}.{name}.weight``), the router
    with ``{moe_prefix}.gate.weight``; the rest as the llama family names them."""
    sparse = set(cfg.sparse_layers())
    out = [("embed_tokens.weight", "model.embed_tokens.weight", False)]
    for i in range(cfg.n_layer):
        ours, theirs = f"layers.{i}", f"model.layers.{i}"
        out += [(f"{ours}.{n}", f"{theirs}.{n}", False) for n in _ATTENTION + extra_attention]
        if i not in sparse:
            out += [(f"{ours}.{n}", f"{theirs}.{n}", False) for n in _DENSE]
            continue
        out.append((f"{ours}.mlp.gate.weight", f"{theirs}.{moe_prefix}.gate.weight", False))
        for mine, hf in zip(("gate_proj", "up_proj", "down_proj"), expert_names):
            names = tuple(f"{theirs}.{moe_prefix}.experts.{e}.{hf}.weight" for e in range(cfg.num_experts))
            out.append((f"{ours}.mlp.experts.{mine}", names, False))
    out.append(("norm.weight", "model.norm.weight", False))
    if not cfg.tie_embeddings:
        out.append(("lm_head.weight", "lm_head.weight", False))
    return out


def moe_hf_fused(cfg) -> dict[str, tuple[str, int, int]]:
    """transformers 5's own layout, of a checkpoint saved with ``save_original_format=False``
    (``mlp.gate.weight`` the router, ``mlp.experts.gate_up_proj`` (E, 2F, D): gate then up,
    ``mlp.experts.down_proj`` (E, D, F)): our tensor -> (its tensor, which part along dim 1,
    of how many parts)."""
    out = {}
    for i in cfg.sparse_layers():
        out[f"layers.{i}.mlp.gate.weight"] = (f"model.layers.{i}.mlp.gate.weight", 0, 1)
        theirs = f"model.layers.{i}.mlp.experts"
        out[f"layers.{i}.mlp.experts.gate_proj"] = (f"{theirs}.gate_up_proj", 0, 2)
        out[f"layers.{i}.mlp.experts.up_proj"] = (f"{theirs}.gate_up_proj", 1, 2)
        out[f"layers.{i}.mlp.experts.down_proj"] = (f"{theirs}.down_proj", 0, 1)
    return out


def hf_map(cfg: MixtralConfig):
    return moe_hf_map(cfg, "block_sparse_moe", ("w1", "w3", "w2"))


SPEC = ModelSpec(
    family="mixtral",
    build=lambda cfg, vocab_size, seed: Mixtral(cfg, vocab_size, seed=seed),
    blocks=lambda model: list(model.layers),
    init_weights=init_weights,
    flops_per_token=lambda model: model.flops_per_token(),
    vocab_rows=vocab_rows,
    hf_map=hf_map,
    hf_tied=llama.hf_tied,
    hf_fused=moe_hf_fused,
    moe=True,
)
