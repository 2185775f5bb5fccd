"""The qwen3 family's tensor-parallel plan: the llama family's, plus the q and k norms. Under
the column-wise q/k projections a rank holds its heads, (B, T, heads / tp, head_dim); each
norm takes that as the shard of the head dimension (``SequenceParallel`` on dim 2, which
replicates the gain: it normalizes over head_dim only), so the gain's gradient, partial over
the heads of each rank, is all-reduced over the group (transformers'
``replicated_with_grad_allreduce``; torchtitan's qwen3 plan does the same)."""

from __future__ import annotations

import torch.nn as nn

from stoker.families.llama import parallel as llama


def parallelize(model: nn.Module, tp_mesh) -> None:
    from torch.distributed.tensor.parallel import SequenceParallel

    norms = {f"self_attn.{n}": SequenceParallel(sequence_dim=2, use_local_output=True) for n in ("q_norm", "k_norm")}
    llama.parallelize(model, tp_mesh, extra=norms)
