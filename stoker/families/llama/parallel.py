"""The llama family's tensor-parallel plan (``engine.parallelism: fsdp+tp``): torchtitan's
(``parallelize_llama``/``apply_tp``), with this model's names.

- each block: q/k/v and gate/up ``ColwiseParallel`` (each rank holds n_head / tp query heads,
  n_kv_head / tp key/value heads and intermediate_size / tp of the MLP), o/down
  ``RowwiseParallel`` with a sequence-sharded output, the two RMSNorms ``SequenceParallel``
  (the residual stream between the blocks is sharded on the sequence), the attention and MLP
  inputs all-gathered (``PrepareModuleInput``);
- the embedding ``RowwiseParallel`` (rows of the vocabulary) with a sequence-sharded output,
  the final norm ``SequenceParallel``, the output ``ColwiseParallel`` (rows of the vocabulary).

Tied embeddings (Llama's default here, not torchtitan's): the embedding's row-wise split and
the output's column-wise split both shard the (vocabulary, n_embd) matrix on its rows, the
same ``Shard(0)``, so the one matrix stays one parameter: ``parallelize_module`` makes a DTensor
for each module, and the plan ties the output to the embedding's again.

What every plan shares (the mesh, the checks of the sizes, the vocabulary-parallel loss) is the
trainer's (``training.parallel``); ``extra`` lets a family built on this one (qwen3) add the
styles of its own modules of a block.
"""

from __future__ import annotations

import torch.nn as nn


def block_plan() -> dict:
    """The styles of one block's modules, by name."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel

    return {
        "input_layernorm": SequenceParallel(),
        # (x, cos, sin, mask): the sequence-sharded x gathered, the RoPE tables and the
        # document mask (of the whole sequence, made from the token ids) as they are
        "self_attn": PrepareModuleInput(
            input_layouts=(Shard(1), None, None, None), desired_input_layouts=(Replicate(), None, None, None)
        ),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }


def parallelize(model: nn.Module, tp_mesh, extra: dict | None = None) -> None:
    """Split a Llama (on any device, the meta device included) over the "tp" mesh in place
    (see the module docstring); ``extra``: more styles for each block's modules."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    tied = model.lm_head.weight is model.embed_tokens.weight
    parallelize_module(
        model,
        tp_mesh,
        {
            "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            # the logits without targets; the loss takes the weight (training.parallel)
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        },
    )
    if tied:  # both Shard(0) of the same matrix: one parameter again
        model.lm_head.weight = model.embed_tokens.weight
    # the embedding's output is a view of a DTensor's local shard (to_local); taken as it is by
    # the first compiled block, AOT autograd (torch 2.13) sends the embedding no gradient at all
    # (measured: zero with the aot_eager backend, right with dynamo's eager one; the view is the
    # likely cause). A copy, of (B, T/tp, C), keeps it connected.
    model.embed_tokens.register_forward_hook(lambda module, args, output: output.clone())
    for block in model.layers:
        parallelize_module(block, tp_mesh, {**block_plan(), **(extra or {})})
