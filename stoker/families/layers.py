"""What every family's forward shares: activation checkpointing of a block (full or
selective), the output layer with its cross-entropy (whole, or a chunk of tokens at a time so
the (tokens x vocabulary) logits never exist), and the padding of the vocabulary rows. The
attention itself (document masks, flex attention, SDPA) is ``families.attention``."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


def _kept_ops() -> frozenset:
    """What selective activation checkpointing keeps: the outputs of the matmuls and of the
    attention kernels (every backend's), the block's expensive ops. The rest (LayerNorm,
    GELU, dropout, residual adds, reshapes) is recomputed in the backward pass."""
    names = (
        "mm",
        "addmm",
        "bmm",
        "_scaled_mm",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_attention_math",
    )
    kept = {getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n)}
    if hasattr(torch.ops.higher_order, "flex_attention"):  # document attention's fused kernel (torchtitan keeps it)
        kept.add(torch.ops.higher_order.flex_attention)
    return frozenset(kept)


_KEPT = _kept_ops()


def _keep_matmuls_and_attention(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _KEPT else CheckpointPolicy.PREFER_RECOMPUTE


def checkpointed(fn, *args: torch.Tensor, mode: str) -> torch.Tensor:
    """fn(*args) under activation checkpointing: 'full' keeps only its inputs and recomputes
    the whole of it in the backward pass; 'selective' also keeps the outputs of its matmuls
    and attention and recomputes only the cheap ops between them."""
    if mode == "selective":
        return checkpoint(
            fn,
            *args,
            use_reentrant=False,
            context_fn=partial(create_selective_checkpoint_contexts, _keep_matmuls_and_attention),
        )
    return checkpoint(fn, *args, use_reentrant=False)


def checkpoint_blocks(blocks, mode: str) -> None:
    """Activation checkpointing ('none', 'selective' or 'full') of each block, applied by the
    engine first, then compile, then fully_shard (torchtitan's order). Each block's forward is
    wrapped on the instance: its parameters keep their names (checkpoints and the Hugging Face
    map see no wrapper), and a block compiled afterwards holds the checkpoint inside its graph,
    where the selective policy sees its matmuls (a checkpoint around a compiled block would
    recompute the whole compiled forward, whatever the policy)."""
    if mode == "none":
        return
    for block in blocks:
        body = type(block).forward.__get__(block)  # the class's own forward, never a wrapper
        block.forward = partial(_checkpointed_forward, block, body, mode)


def _checkpointed_forward(block, body, mode: str, *args, **kwargs):
    if not block.training:  # evaluation keeps nothing for a backward pass anyway
        return body(*args, **kwargs)
    return checkpointed(partial(body, **kwargs), *args, mode=mode)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of ``h @ weight.T`` against ``targets``, ``chunk`` rows at a time.
    The gradients of h and weight are computed in the forward pass, chunk by chunk (the
    softmax minus the one-hot target, through the two matmuls), so at most one chunk's logits
    exist at a time and the backward pass only scales them. The matmuls run in the autocast
    dtype as the full-logits path does; the log-softmax in fp32."""

    @staticmethod
    def forward(ctx, h, weight, targets, chunk: int):
        n = h.shape[0]
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        rows = torch.arange(min(chunk, n), device=h.device)
        for start in range(0, n, chunk):
            hc, tc = h[start : start + chunk], targets[start : start + chunk]
            raw = hc @ weight.t()  # (chunk, V) in the matmul dtype
            logits = raw.float()
            lse = torch.logsumexp(logits, dim=-1)
            at = rows[: len(tc)]
            loss += (lse - logits[at, tc]).sum()
            g = torch.exp(logits - lse[:, None])  # softmax
            g[at, tc] -= 1.0
            g = (g / n).to(raw.dtype)
            grad_h[start : start + chunk] = g @ weight
            grad_w += g.t() @ hc
        ctx.save_for_backward(grad_h, grad_w)
        ctx.weight_dtype = weight.dtype
        return loss / n

    @staticmethod
    def backward(ctx, grad_loss):
        grad_h, grad_w = ctx.saved_tensors
        return grad_h * grad_loss, (grad_w * grad_loss).to(ctx.weight_dtype), None, None


@torch.no_grad()
def _chunked_loss_only(h, weight, targets, chunk: int) -> torch.Tensor:
    loss = torch.zeros((), dtype=torch.float32, device=h.device)
    for start in range(0, h.shape[0], chunk):
        loss += F.cross_entropy(
            (h[start : start + chunk] @ weight.t()).float(), targets[start : start + chunk], reduction="sum"
        )
    return loss / h.shape[0]


def chunked_cross_entropy(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int) -> torch.Tensor:
    """The mean cross-entropy of the logits ``h @ weight.T`` (h: (N, C), weight: (V, C),
    targets: (N,)), computed ``chunk`` tokens at a time: equal to the full-logits loss up to
    rounding, and its gradients too, while holding one chunk of logits instead of N."""
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return _ChunkedCrossEntropy.apply(h, weight, targets, chunk)
    return _chunked_loss_only(h, weight, targets, chunk)


def logits_and_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor):
    """The output layer and the full-logits cross-entropy: h (B, T, C), weight (V, C). A plain
    function of tensors so that it can be compiled on its own (FSDP2 compiles per block, and
    this is the rest of the step's heavy work: the vocabulary-wide matmul and softmax)."""
    logits = F.linear(h, weight)  # (B, T, V_padded)
    loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), targets.reshape(-1))
    return logits, loss


def padded_vocab(vocab_size: int, multiple: int) -> int:
    return -(-vocab_size // multiple) * multiple
