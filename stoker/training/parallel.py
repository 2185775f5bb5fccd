"""Tensor parallel under FSDP2 (``engine.parallelism: fsdp+tp``): torchtitan's 2D parallelism.

The ranks form a 2D device mesh ("dp", "tp") of shape (world / tp_degree, tp_degree), tp
innermost: the ranks of one tensor-parallel group are consecutive, so they sit on one node
(the config asks tp_degree to divide launch.nproc_per_node). Each group holds one replica of
the model, split by ``apply_tp``; FSDP2 then shards each replica's pieces over "dp" (the
engine's ``_build_fsdp``). The ranks of a group compute on the same micro-batch: the data
split is over the "dp" coordinate only (``data_parallel``).

Each family with a plan has it in its folder (``families/<name>/parallel.py``, the spec's
``parallelize``: torchtitan's ``parallelize_llama`` for the llama family); ``apply_tp`` checks
that the family's sizes divide (``tp_split_sizes``) and applies it.

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

from stoker.failures import ConfigError
from stoker.families import FAMILIES, spec_of


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
        planned = ", ".join(name for name, cls in FAMILIES.items() if cls.TENSOR_PARALLEL)
        return [
            f"engine.parallelism: 'fsdp+tp' has a tensor-parallel plan for the {planned} families only, and "
            f"model.family is {getattr(model_cfg, 'family', None)!r}; use 'fsdp' or 'ddp'"
        ]
    return [
        f"engine.tp_degree: {tp_degree} does not divide model.{name}={value}; use a common divisor"
        for name, value in model_cfg.tp_split_sizes()
        if value is not None and value % tp_degree
    ]


def apply_tp(model: nn.Module, tp_mesh) -> None:
    """Split a model over the "tp" mesh in place by its family's plan (the spec's
    ``parallelize``), after checking that the sizes divide, and give it the
    vocabulary-parallel loss."""
    problems = tp_problems(model.cfg, tp_mesh.size())
    if problems:
        raise ConfigError(problems)
    spec_of(model.cfg).parallelize(model, tp_mesh)
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


# ---- expert parallel (engine.ep_degree): a mixture's experts split over groups of ranks --------
def apply_ep(model: torch.nn.Module, ep_mesh) -> None:
    """Each sparse layer's stacked expert weights (E, ...) as DTensors sharded on dim 0 over the
    "ep" mesh (a rank holds E / ep consecutive experts), and its dispatch over that group: the
    tokens of a rank go to their expert's rank by all-to-all (families.moe). On any device, the
    meta device included (before fully_shard and the materialization)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for block in model.layers:
        if not getattr(block, "sparse", False):
            continue
        experts = block.mlp.experts
        for name, p in list(experts.named_parameters(recurse=False)):
            experts.register_parameter(
                name, torch.nn.Parameter(distribute_tensor(p.data, ep_mesh, [Shard(0)], src_data_rank=None))
            )
        block.mlp.ep_group = ep_mesh.get_group()
        # an expert's gradient is the sum over every rank's tokens routed to it, made on its own
        # rank; FSDP2 then averages over the world / ep ranks holding it: 1 / ep more gives the
        # average over the world that every other parameter gets
        experts.grad_scale = 1.0 / ep_mesh.size()


def clip_grad_norm_sharded(params, max_norm: float) -> torch.Tensor:
    """clip_grad_norm_ for gradients sharded over several meshes (expert parallel: the experts'
    over (dp, ep), the rest over the world), none replicated: the global norm is the square root
    of the sum over ranks of each rank's local sum of squares; every gradient scaled by
    max_norm / (norm + 1e-6) where that is below 1 (torch's rule)."""
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    total = torch.zeros((), dtype=torch.float32, device=local[0].device if local else "cpu")
    for g in local:
        total += g.detach().float().pow(2).sum()
    dist.all_reduce(total)  # group: world
    norm = total.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in local:
        g.mul_(coef.to(g.dtype))
    return norm
