"""Tensor parallel under FSDP2 (``engine.parallelism: fsdp+tp``): torchtitan's 2D parallelism.

The ranks form a 2D device mesh ("dp", "tp") of shape (world / tp_degree, tp_degree), tp
innermost: the ranks of one tensor-parallel group are consecutive, so they sit on one node
(the config asks tp_degree to divide launch.nproc_per_node). Each group holds one replica of
the model, split by ``apply_tp``; FSDP2 then shards each replica's pieces over "dp" (the
engine's ``_build_fsdp``). The ranks of a group compute on the same micro-batch: the data
split is over the "dp" coordinate only (``data_parallel``).

The Llama plan is torchtitan's (``parallelize_llama``/``apply_tp``), with this model's names:

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
for each module, and ``apply_tp`` ties the output to the embedding's again.

The loss is vocabulary-parallel (torchtitan's loss parallel, done by hand so that it needs no
context around the backward pass): each rank makes the logits of its rows of the vocabulary
only, and the log-sum-exp and the targets' logits are all-reduced over the group
(``parallel_logits_and_loss``); the full logits never exist on a rank. The logits path
without targets (``model(idx)``) gathers the full logits.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from stoker.core.failures import ConfigError


def data_parallel(rank: int, world_size: int, tp_degree: int) -> tuple[int, int]:
    """(this rank's data-parallel coordinate, the data-parallel size): the "dp" coordinate of
    the (dp, tp) mesh, tp innermost. The ranks of one tensor-parallel group read the same
    micro-batches. With tp_degree 1: (rank, world_size)."""
    return rank // tp_degree, world_size // tp_degree


def device_mesh_2d(device_type: str, world_size: int, tp_degree: int):
    """The ("dp", "tp") mesh of shape (world_size / tp_degree, tp_degree)."""
    from torch.distributed.device_mesh import init_device_mesh

    if tp_degree < 2 or world_size % tp_degree:
        raise ConfigError(
            [
                f"engine.tp_degree: {tp_degree} does not split the {world_size} ranks into tensor-parallel "
                "groups of 2 or more; use a divisor of launch.nproc_per_node above 1"
            ]
        )
    return init_device_mesh(device_type, (world_size // tp_degree, tp_degree), mesh_dim_names=("dp", "tp"))


def tp_problems(model_cfg, tp_degree: int) -> list[str]:
    """What keeps a model section from a split over tp_degree ranks (the config refuses it
    too; the rank checks again after a base filled in the architecture)."""
    if not getattr(type(model_cfg), "TENSOR_PARALLEL", False):
        return [
            f"engine.parallelism: 'fsdp+tp' has a tensor-parallel plan for the llama family only, and "
            f"model.family is {getattr(model_cfg, 'family', None)!r}; use 'fsdp' or 'ddp'"
        ]
    return [
        f"engine.tp_degree: {tp_degree} does not divide model.{name}={value}; use a common divisor"
        for name, value in tp_split_sizes(model_cfg)
        if value is not None and value % tp_degree
    ]


def tp_split_sizes(model_cfg) -> list[tuple[str, int | None]]:
    """The sizes a tensor-parallel split divides: the heads and the MLP (column-wise), the
    sequence (sequence parallel)."""
    return [(n, getattr(model_cfg, n, None)) for n in ("n_head", "n_kv_head", "intermediate_size", "block_size")]


def apply_tp(model: nn.Module, tp_mesh) -> None:
    """Split a Llama (on any device, the meta device included) over the "tp" mesh in place,
    by torchtitan's plan (see the module docstring)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    problems = tp_problems(model.cfg, tp_mesh.size())
    if problems:
        raise ConfigError(problems)
    tied = model.lm_head.weight is model.embed_tokens.weight
    parallelize_module(
        model,
        tp_mesh,
        {
            "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            # the logits without targets; the loss takes the weight (parallel_logits_and_loss)
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
        parallelize_module(
            block,
            tp_mesh,
            {
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
            },
        )
    model.output_loss = parallel_logits_and_loss


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """The mean cross-entropy of logits split by vocabulary rows over a process group: each
    rank gives its (N, V/tp) columns, the first being vocabulary row ``start``. Max, sum of
    exponentials and the targets' logits are all-reduced (three (N,) collectives); the
    gradient (softmax minus the one-hot target, over N) is made in the forward pass from the
    local columns alone, so the backward pass has no collective (Megatron's
    vocab_parallel_cross_entropy; torch's loss_parallel computes the same)."""

    @staticmethod
    def forward(ctx, logits, targets, start: int, group):
        x = logits.float()  # (N, V_local)
        n, cols = x.shape
        peak = x.max(dim=-1).values
        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
        e = torch.exp(x - peak[:, None])
        total = e.sum(dim=-1)
        dist.all_reduce(total, group=group)
        local = targets - start
        mine = (local >= 0) & (local < cols)
        at = torch.where(mine, local, torch.zeros_like(local))
        target_logit = torch.where(mine, x.gather(1, at[:, None]).squeeze(1) - peak, torch.zeros_like(peak))
        dist.all_reduce(target_logit, group=group)
        loss = (torch.log(total) - target_logit).mean()
        grad = e / total[:, None]  # the softmax of the local columns
        rows = torch.arange(n, device=x.device)
        grad[rows[mine], at[mine]] -= 1.0
        ctx.save_for_backward((grad / n).to(logits.dtype))
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        (grad,) = ctx.saved_tensors
        return grad * grad_loss, None, None, None


def parallel_logits_and_loss(h, weight, targets):
    """(None, the mean cross-entropy) of the output layer under tensor parallel: h is the
    final norm's sequence-sharded output (a DTensor), weight the output matrix split by
    vocabulary rows (a DTensor, Shard(0)). The sequence is all-gathered (its gradient,
    partial over the vocabulary split, is reduce-scattered back), each rank makes the logits
    of its vocabulary rows, and the loss is vocabulary-parallel."""
    from torch.distributed.tensor import Partial, Replicate
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh = weight.device_mesh
    full = h.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])  # (B, T, C)
    _, offset = compute_local_shape_and_global_offset(weight.shape, mesh, weight.placements)
    logits = F.linear(full, weight.to_local())  # (B, T, V_local): this rank's vocabulary rows
    loss = _VocabParallelCrossEntropy.apply(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), offset[0], mesh.get_group()
    )
    return None, loss
