"""What every mixture-of-experts family shares (torch): the token-choice top-k router, the
experts as grouped weights, the token dispatch (local, or all-to-all over an expert-parallel
group) and the Switch load-balancing loss. A family folder (qwen3_moe, mixtral) only says
which of its layers are sparse and how its names map to Hugging Face's.

References: torchtitan's ``models/common/moe.py`` (``TokenChoiceTopKRouter``,
``GroupedExperts`` over stacked ``[E, ...]`` weights with ``torch._grouped_mm``, the all-to-all
token dispatcher of expert parallelism) and transformers' ``Qwen3MoeSparseMoeBlock`` /
``MixtralSparseMoeBlock`` (softmax over the experts, top-k, ``norm_topk_prob``; the routing
weight multiplies each expert's output; ``load_balancing_loss_func``), whose numerics these
follow op for op so that a base's logits are transformers' in fp32.

- ``TopKRouter``: logits (N, E) = x W^T, probabilities by softmax in fp32, the top k of them
  (renormalized to sum to 1 under ``norm_topk_prob``).
- ``GroupedExperts``: the experts' SwiGLU weights stacked, gate and up (E, F, D), down (E, D, F).
  Tokens sorted by expert run as one grouped matmul per projection (``torch._grouped_mm``:
  bf16 on CUDA, fp32 on the CPU; its strides must be multiples of 16 bytes, which D and F of
  every real base are); ``impl='loop'`` is the exact reference, one matmul per expert.
- ``SparseMoE``: router, dispatch, experts, the weighted sum back at each token. Its forward
  returns the output and the router's statistics of this micro-batch, a (2, E) tensor: the
  top-k assignments per expert (no gradient) and the summed probabilities (with gradient), from
  which the model computes the load-balancing loss over all its sparse layers at once (as
  transformers does: the assignment and probability means are over every layer's tokens).
- expert parallelism (``engine.ep_degree``): each rank of an expert-parallel group holds
  E / ep of each layer's experts (the DTensor's Shard(0) of the stacked weights); a rank's tokens
  go to the rank holding their expert by ``all_to_all_single`` and come back the same way.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

# rows of each expert's group rounded up to this on CUDA (the grouped kernel's 16-byte alignment
# of each group's start in bf16); the CPU's kernel needs none
CUDA_GROUP_ALIGN = 16
# steps in a row with no token for an expert before the trainer warns (events.IdleExperts)
IDLE_WARN_STEPS = 50


class TopKRouter(nn.Module):
    """Token-choice top-k routing over softmax probabilities (transformers' TopKRouter)."""

    def __init__(self, dim: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__()
        self.num_experts, self.top_k, self.norm_topk_prob = num_experts, top_k, norm_topk_prob
        self.weight = nn.Parameter(torch.empty(num_experts, dim))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (N, D) -> (probabilities (N, E) fp32, top-k weights (N, k) in x's dtype, top-k
        expert ids (N, k))."""
        logits = F.linear(x, self.weight)  # (N, E)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top_w, top_i = torch.topk(probs, self.top_k, dim=-1)  # (N, k)
        if self.norm_topk_prob:
            top_w = top_w / top_w.sum(dim=-1, keepdim=True)
        return probs, top_w.to(logits.dtype), top_i


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """x (M, K) rows grouped by expert (group g ends at offs[g]) times w[g]^T, w (E, N, K):
    (M, N)."""
    out = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
    if out.requires_grad:  # the kernel's backward refuses an expanded gradient (a sum's: strides 0)
        out.register_hook(torch.Tensor.contiguous)
    return out


def grouped_mm_aligned(dim: int, dtype: torch.dtype) -> bool:
    """Whether the grouped kernel takes rows of ``dim`` elements (16-byte strides)."""
    return (dim * torch.empty((), dtype=dtype).element_size()) % 16 == 0


class GroupedExperts(nn.Module):
    """E SwiGLU experts as stacked weights: gate_proj, up_proj (E, F, D), down_proj (E, D, F)."""

    def __init__(self, num_experts: int, dim: int, hidden: int, impl: str = "grouped"):
        super().__init__()
        if impl not in ("grouped", "loop"):
            raise ValueError(f"experts impl {impl!r}: 'grouped' or 'loop'")
        self.impl = impl
        self.gate_proj = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.up_proj = nn.Parameter(torch.empty(num_experts, hidden, dim))
        self.down_proj = nn.Parameter(torch.empty(num_experts, dim, hidden))
        self.grad_scale = 1.0  # expert parallel: 1 / ep_degree (training.parallel.apply_ep)

    def _local(self, p: torch.Tensor) -> torch.Tensor:
        """The experts this rank holds: an expert-parallel DTensor's local shard (FSDP2 has
        gathered its own dimension by the time the forward runs), its gradient scaled by
        grad_scale."""
        if not hasattr(p, "to_local"):
            return p
        local = p.to_local()
        if self.grad_scale != 1.0 and local.requires_grad:
            scale = self.grad_scale
            local.register_hook(lambda grad: grad * scale)
        return local

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """x (M, D): tokens sorted by expert, counts (E_local,) of them per expert (their sum
        M); (M, D): each token through its expert."""
        gate, up, down = (self._local(p) for p in (self.gate_proj, self.up_proj, self.down_proj))
        dim, hidden = gate.shape[2], gate.shape[1]
        if self.impl == "grouped" and grouped_mm_aligned(dim, x.dtype) and grouped_mm_aligned(hidden, x.dtype):
            align = CUDA_GROUP_ALIGN if x.is_cuda else 1
            return self._grouped(x, counts, gate.to(x.dtype), up.to(x.dtype), down.to(x.dtype), align)
        return self._loop(x, counts, gate, up, down)

    @staticmethod
    def _grouped(x, counts, gate, up, down, align: int = 1) -> torch.Tensor:
        """The grouped path; ``align`` > 1 pads each expert's rows to a multiple of it (CUDA's)."""
        if align == 1:
            offs = torch.cumsum(counts, 0, dtype=torch.int32)
            h = F.silu(grouped_mm(x, gate, offs)) * grouped_mm(x, up, offs)
            return grouped_mm(h, down, offs)
        # each group's rows padded up to a multiple of align (zeros, dropped after): a static
        # bound, M + E x (align - 1), so no host sync
        padded = (counts + align - 1) // align * align
        ends = torch.cumsum(padded, 0)
        starts = ends - padded
        first = torch.cumsum(counts, 0) - counts
        expert = torch.repeat_interleave(torch.arange(len(counts), device=x.device), counts, output_size=x.shape[0])
        rows = starts[expert] + torch.arange(x.shape[0], device=x.device) - first[expert]  # (M,)
        buf = x.new_zeros((x.shape[0] + len(counts) * (align - 1), x.shape[1]))
        buf = buf.index_copy(0, rows, x)
        offs = ends.to(torch.int32)
        h = F.silu(grouped_mm(buf, gate, offs)) * grouped_mm(buf, up, offs)
        return grouped_mm(h, down, offs)[rows]

    @staticmethod
    def _loop(x, counts, gate, up, down) -> torch.Tensor:
        """The exact reference: one SwiGLU per expert on its rows (a host sync on the counts)."""
        out, start = [], 0
        for e, n in enumerate(counts.tolist()):
            xe = x[start : start + n]
            h = F.silu(F.linear(xe, gate[e])) * F.linear(xe, up[e])
            out.append(F.linear(h, down[e]))
            start += n
        return torch.cat(out) if out else x[:0]


class SparseMoE(nn.Module):
    """A sparse MLP: each token through its top-k experts, their outputs weighted by the
    router's (transformers' SparseMoeBlock, op for op)."""

    def __init__(
        self, dim: int, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool, impl: str = "grouped"
    ):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.gate = TopKRouter(dim, num_experts, top_k, norm_topk_prob)
        self.experts = GroupedExperts(num_experts, dim, hidden, impl)
        self.ep_group = None  # an expert-parallel process group (training.engine), else local

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (B, T, D) -> (output (B, T, D), router statistics (2, E): assignments per expert,
        summed probabilities per expert, over this micro-batch's B x T tokens)."""
        B, T, D = x.shape
        flat = x.reshape(-1, D)  # (N, D)
        probs, top_w, top_i = self.gate(flat)
        assigned = top_i.reshape(-1)  # (N k,)
        counts = torch.bincount(assigned, minlength=self.num_experts)  # (E,)
        order = torch.argsort(assigned, stable=True)  # the assignments grouped by expert
        token = order // self.top_k  # (N k,): the token of each sorted assignment
        routed = flat[token]
        if self.ep_group is None:
            y = self.experts(routed, counts)
        else:
            y = _expert_parallel(self.experts, routed, counts, self.ep_group)
        y = y * top_w.reshape(-1)[order, None]
        out = torch.zeros_like(flat).index_add_(0, token, y.to(flat.dtype))
        stats = torch.stack([counts.detach().to(torch.float32), probs.sum(dim=0)])  # (2, E)
        return out.view(B, T, D), stats


# ---- expert parallelism: the all-to-all token dispatch ------------------------------------------
class _AllToAll(torch.autograd.Function):
    """all_to_all_single with split sizes, differentiable (the backward sends the gradients back
    along the reverse splits)."""

    @staticmethod
    def forward(ctx, x, out_splits: list[int], in_splits: list[int], group):
        import torch.distributed as dist

        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def _expert_parallel(experts: GroupedExperts, routed: torch.Tensor, counts: torch.Tensor, group) -> torch.Tensor:
    """The tokens of this rank (sorted by global expert id, ``counts`` per expert) through the
    experts of the whole expert-parallel group: each rank holds E / ep consecutive experts;
    tokens go to their expert's rank and come back in the same order."""
    import torch.distributed as dist

    ep = dist.get_world_size(group)
    E = counts.shape[0]
    local = E // ep
    # how many tokens each rank sends to each expert of every rank: (ep, local) per rank
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)  # [src rank r: its counts of my experts]
    send_splits = counts.view(ep, local).sum(dim=1).tolist()
    recv_by_src = recv_counts.view(ep, local)  # (src, my expert)
    recv_splits = recv_by_src.sum(dim=1).tolist()
    received = _AllToAll.apply(routed, recv_splits, send_splits, group)  # grouped by src, then expert
    # regroup by my expert (then src), run, and put back in (src, expert) order
    src_of = torch.repeat_interleave(
        torch.arange(ep * local, device=routed.device), recv_by_src.reshape(-1), output_size=received.shape[0]
    )  # the (src, expert) cell of each received row
    key = (src_of % local) * ep + src_of // local  # expert-major order
    order = torch.argsort(key, stable=True)
    out = torch.empty_like(received)
    out[order] = experts(received[order], recv_by_src.sum(dim=0))
    return _AllToAll.apply(out, send_splits, recv_splits, group)


def load_balancing_loss(stats: list[torch.Tensor], rows: int, top_k: int) -> torch.Tensor:
    """The Switch load-balancing loss over every sparse layer (transformers'
    ``load_balancing_loss_func`` without padding): E x sum_e f_e P_e, where f_e is the share of
    top-k assignments that went to expert e and P_e its mean router probability, both over all
    layers' ``rows`` tokens each (rows: tokens of one layer)."""
    total = torch.stack(stats).sum(dim=0)  # (2, E)
    n = rows * len(stats)
    E = total.shape[1]
    return E * torch.sum((total[0] / n) * (total[1] / n))


class RouterLoad:
    """The router's load as the trainer shows it: per sparse layer, the busiest and idlest
    expert's share of the top-k assignments over each log interval (summed over ranks), and
    the experts that got nothing for ``warn_steps`` steps in a row (said once per layer)."""

    def __init__(self, layers: list[int], num_experts: int, warn_steps: int = IDLE_WARN_STEPS):
        self.layers, self.warn_steps = layers, warn_steps
        self.idle_since = torch.zeros(len(layers), num_experts, dtype=torch.int64)  # steps without a token
        self.warned: set[int] = set()

    def step(self, counts: torch.Tensor, steps: int) -> list[tuple[int, list[int], int]]:
        """At a log step: counts (sparse layers, E) of the assignments of the interval's
        ``steps`` steps, over every rank; returns (layer, experts, steps idle) for each layer
        whose idle experts reach warn_steps now."""
        idle = counts.cpu() == 0
        self.idle_since = torch.where(idle, self.idle_since + steps, torch.zeros_like(self.idle_since))
        out = []
        for i, layer in enumerate(self.layers):
            reached = (self.idle_since[i] >= self.warn_steps).nonzero().flatten().tolist()
            if reached and layer not in self.warned:
                self.warned.add(layer)
                out.append((layer, reached, int(self.idle_since[i].max())))
        return out

    def shares(self, interval: torch.Tensor) -> dict:
        """{"layers", "busiest", "idlest"}: each sparse layer's largest and smallest share of
        the interval's assignments."""
        total = interval.sum(dim=1, keepdim=True).clamp(min=1)
        share = (interval / total).cpu()
        return {
            "layers": list(self.layers),
            "busiest": [round(float(v), 4) for v in share.max(dim=1).values],
            "idlest": [round(float(v), 4) for v in share.min(dim=1).values],
        }
