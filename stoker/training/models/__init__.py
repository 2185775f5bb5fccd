"""Model families behind one spec (torchtitan's ``ModelSpec``; litgpt's converters).

The trainer, evaluation, export and the benchmarks ask ``spec_of(cfg.model)`` for everything
that differs between families, and never name a family:

- ``build(cfg, vocab_size, seed)``: the module for a tokenizer of ``vocab_size`` ids, with
  ``vocab_rows(cfg, vocab_size)`` embedding rows (``seed=None``: uninitialized, for a meta-device
  build that FSDP2 shards and ``init_weights`` then fills);
- ``blocks(model)``: the repeated blocks that activation checkpointing, compile and
  ``fully_shard`` wrap, in that order, by the engine;
- ``init_weights(model, seed)``: every parameter a pure function of (seed, its name), on plain
  and FSDP2-sharded parameters alike;
- ``flops_per_token(model)``: training FLOPs per token (the MFU of the step line);
- ``vocab_rows(cfg, tokenizer_vocab)``: the embedding rows (padded, or a base's own count);
  a Hugging Face export holds ``hf_rows``: the base's count, else the tokenizer's;
- ``hf_map(cfg)``: the Hugging Face adapter as a name map, ``[(ours, theirs, transpose)]``,
  from which both directions (``to_hf``/``from_hf``, exact inverses) and the sharded load of a
  base (``training.base``) are derived; ``hf_extra_to`` writes what HF has and we do not
  (GPT-2's zero biases). The config.json half of the adapter is torch-free, with the
  family's fields (``core.config.models``).

Every model's forward is ``forward(idx, targets=None) -> (logits | None, loss | None)``: logits
(B, T, vocab_size) without targets, the loss (and logits unless chunked) with them; it has
``cfg``, ``vocab_size``, ``loss_chunk`` and
``output_loss`` (the compiled output layer and loss, swapped in by the engine).
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from stoker.training.models.spec import ModelSpec, hf_rows, is_vocab, param_groups

__all__ = ["ModelSpec", "build_model", "hf_rows", "is_vocab", "param_groups", "spec_of"]


def spec_of(model_cfg: Any) -> ModelSpec:
    """The spec of a model section's family (``cfg.model``)."""
    family = getattr(model_cfg, "family", model_cfg)
    if family == "gpt2":
        from stoker.training.models.gpt2 import SPEC
    elif family == "llama":
        from stoker.training.models.llama import SPEC
    else:
        raise ValueError(f"model.family: {family!r} is not a model family")
    return SPEC


def build_model(model_cfg: Any, vocab_size: int, seed: int | None) -> nn.Module:
    """The model of a config for a tokenizer of ``vocab_size`` ids (rows as the family pads)."""
    return spec_of(model_cfg).build(model_cfg, vocab_size, seed)
