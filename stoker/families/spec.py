"""The spec every model family fills in (see ``stoker.families``), the Hugging Face
conversion derived from a family's name map, and what every family shares (parameter groups)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn


@dataclass(frozen=True)
class ModelSpec:
    family: str
    build: Callable[[Any, int, "int | None"], nn.Module]  # (cfg, tokenizer vocab_size, seed)
    blocks: Callable[[nn.Module], list[nn.Module]]
    init_weights: Callable[[nn.Module, int], None]
    flops_per_token: Callable[[nn.Module], float]
    vocab_rows: Callable[[Any, int], int]
    hf_map: Callable[[Any], list[tuple[str, str, bool]]]
    # HF tensors with no counterpart here, made from the config (GPT-2's biases under
    # model.bias: false are zeros): (cfg, our state dict) -> {hf name: tensor}
    hf_extra_to: Callable[[Any, dict], dict] = lambda cfg, sd: {}
    # our tensors that HF does not store (a tied output matrix): ours -> the HF name it equals
    hf_tied: Callable[[Any], dict[str, str]] = lambda cfg: {}
    # the tensor-parallel plan (model, tp mesh), applied in place; None: the family has none
    # (its config's TENSOR_PARALLEL is false)
    parallelize: Callable[[nn.Module, Any], None] | None = None
    # a mixture's stacked expert weights in transformers 5's fused layout, where a checkpoint
    # holds it instead of per-expert tensors: ours -> (HF name, part along dim 1, parts)
    hf_fused: Callable[[Any], dict[str, tuple[str, int, int]]] = lambda cfg: {}
    # a mixture of experts (families.moe): its forward adds the router's loss in training
    moe: bool = False

    def to_hf(self, cfg: Any, state: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
        """Hugging Face tensors (names, layout) from our state dict; the embedding and output
        rows cut to the tokenizer's ``vocab_size`` when ours are padded beyond it."""
        keep = hf_rows(cfg, vocab_size)
        out = {}
        for ours, theirs, transpose in self.hf_map(cfg):
            t = state[ours]
            if isinstance(theirs, tuple):  # a stacked expert weight: one tensor per expert
                out.update({name: t[e].contiguous() for e, name in enumerate(theirs)})
                continue
            if is_vocab(ours):  # only our padding is cut: the rows of a base stay
                t = t[:keep]
            out[theirs] = (t.t() if transpose else t).contiguous()
        out.update(self.hf_extra_to(cfg, state))
        return out

    def from_hf(self, cfg: Any, hf: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
        """Our state dict from Hugging Face tensors: the exact inverse of ``to_hf`` (padded
        vocabulary rows come back as zeros; tied tensors are the same tensor)."""
        rows = self.vocab_rows(cfg, vocab_size)
        fused = self.hf_fused(cfg)
        out = {}
        for ours, theirs, transpose in self.hf_map(cfg):
            if isinstance(theirs, tuple):  # per-expert tensors stacked, or transformers 5's fused one
                if theirs[0] in hf:
                    out[ours] = torch.stack([hf[name] for name in theirs])
                else:
                    name, part, parts = fused[ours]
                    out[ours] = hf[name].chunk(parts, dim=1)[part].contiguous()
                continue
            if theirs not in hf and ours in fused:  # the fused layout's name of the tensor
                theirs = fused[ours][0]
            t = hf[theirs]
            t = (t.t() if transpose else t).contiguous()
            if ours.endswith("wpe.weight"):  # a base's longer position table: the first rows
                t = t[: cfg.block_size]
            if is_vocab(ours) and t.shape[0] < rows:
                t = torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])
            out[ours] = t
        for ours, theirs in self.hf_tied(cfg).items():
            out[ours] = out[next(o for o, h, _ in self.hf_map(cfg) if h == theirs)]
        return out

    def hf_names(self, cfg: Any) -> list[str]:
        """Every Hugging Face tensor name the adapter writes (a stacked weight's per expert)."""
        out = []
        for _, theirs, _ in self.hf_map(cfg):
            out += list(theirs) if isinstance(theirs, tuple) else [theirs]
        return out


VOCAB_PARAMS = ("wte.weight", "lm_head.weight", "tok_embeddings.weight", "output.weight", "embed_tokens.weight")


def is_vocab(name: str) -> bool:
    return name.endswith(VOCAB_PARAMS)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay 2-D weights (matmuls, embeddings); never biases or LayerNorm gains."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def hf_rows(model_cfg: Any, vocab_size: int) -> int:
    """The embedding rows of a Hugging Face model of this config: the base's own count
    (``model.vocab_size``, where the family has it), else the tokenizer's."""
    return getattr(model_cfg, "vocab_size", None) or vocab_size
