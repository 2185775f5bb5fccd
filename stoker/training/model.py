"""A nanoGPT-sized GPT: pre-norm blocks, causal self-attention, tied embeddings.

The embedding and output rows are padded to ``model.vocab_pad_multiple`` (the extra rows are
never a target, so token ids and the loss are unchanged in meaning). The loss is the full
logits' cross-entropy, or the same loss a chunk of tokens at a time (``chunked_cross_entropy``,
engine.cross_entropy: 'chunked'), which never holds the whole (tokens x vocabulary) logits.
Initial weights are a pure function of the seed and each parameter's name (``init_weights``),
so a model built on the meta device and sharded by FSDP2 starts from the same values as a
replicated one.
"""

from __future__ import annotations

import hashlib
import math
from functools import partial

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from stoker.core.config import ModelConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head, self.n_embd, self.dropout = cfg.n_head, cfg.n_embd, cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # 3 x (B, T, C)
        # (B, nh, T, hs)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)
        self.activation_checkpointing = "none"  # or "selective", "full" (GPT sets it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the checkpoint is inside the block's forward, so a compiled block (FSDP2 compiles
        # each) holds it: the compiler sees the matmuls, and the selective policy saves their
        # outputs. A checkpoint wrapped around a compiled block would recompute the whole
        # compiled forward in the backward pass, whatever the policy (torchtitan's order:
        # checkpoint, then compile, then fully_shard).
        if self.activation_checkpointing != "none" and self.training:
            return checkpointed(self._body, x, self.activation_checkpointing)
        return self._body(x)

    def _body(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


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
    return frozenset(getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n))


_KEPT = _kept_ops()


def _keep_matmuls_and_attention(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _KEPT else CheckpointPolicy.PREFER_RECOMPUTE


def checkpointed(block, x: torch.Tensor, mode: str) -> torch.Tensor:
    """A block under activation checkpointing: 'full' keeps only its input and recomputes
    the whole block in the backward pass; 'selective' also keeps the outputs of its matmuls
    and attention and recomputes only the cheap ops between them."""
    if mode == "selective":
        return checkpoint(
            block,
            x,
            use_reentrant=False,
            context_fn=partial(create_selective_checkpoint_contexts, _keep_matmuls_and_attention),
        )
    return checkpoint(block, x, use_reentrant=False)


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


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, vocab_size: int, *, seed: int | None = 0):
        """seed=None leaves the weights uninitialized (meta-device build; see init_weights)."""
        super().__init__()
        self.cfg, self.vocab_size = cfg, vocab_size
        self.loss_chunk = 0  # tokens per chunk of a chunked cross-entropy; 0: the full logits
        vocab_size = padded_vocab(vocab_size, cfg.vocab_pad_multiple)
        self.wte = nn.Embedding(vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        self._activation_checkpointing = "none"
        # the output layer and loss; the engine swaps in a compiled one under FSDP2
        self.output_loss = logits_and_loss
        if seed is not None:
            init_weights(self, seed)

    @property
    def activation_checkpointing(self) -> str:
        """'none', 'selective' or 'full' (engine.activation_checkpointing), for every block."""
        return self._activation_checkpointing

    @activation_checkpointing.setter
    def activation_checkpointing(self, mode: str) -> None:
        self._activation_checkpointing = mode
        for block in self.blocks:
            block.activation_checkpointing = mode

    def num_params(self, embedding: bool = False) -> int:
        """Parameters (the tied output matrix once); without position embeddings unless asked."""
        n = sum(p.numel() for p in self.parameters())
        return n if embedding else n - self.wpe.weight.numel()

    def flops_per_token(self) -> float:
        """Training FLOPs per token: 6N for the matmuls of forward and backward plus
        12·L·C·T for attention (PaLM appendix B), N without position embeddings."""
        c = self.cfg
        return 6 * self.num_params() + 12 * c.n_layer * c.n_embd * c.block_size

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x)
        if targets is not None and self.loss_chunk:  # the full logits never exist
            h = self.ln_f(x)
            return None, chunked_cross_entropy(
                h.view(B * T, -1), self.lm_head.weight, targets.reshape(-1), self.loss_chunk
            )
        if targets is None:
            return self.lm_head(self.ln_f(x))[..., : self.vocab_size], None  # (B, T, V)
        return self.output_loss(self.ln_f(x), self.lm_head.weight, targets)


def _init_value(name: str, shape: torch.Size, n_layer: int, seed: int) -> torch.Tensor:
    """The initial value of one parameter, from a generator of (seed, name) alone."""
    if name.endswith(".bias") or ".ln_" in name or name.startswith("ln_"):
        return torch.ones(shape) if name.endswith(".weight") else torch.zeros(shape)
    gen = torch.Generator().manual_seed(
        int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1
    )
    # scaled init of residual projections (GPT-2)
    std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else 0.02
    return torch.empty(shape).normal_(0.0, std, generator=gen)


@torch.no_grad()
def init_weights(model: GPT, seed: int) -> None:
    """Set every parameter to its initial value. Works on plain and FSDP2-sharded (DTensor)
    parameters alike: each rank fills only its own shard, with no communication."""
    for name, p in model.named_parameters():
        full = _init_value(name, p.shape, model.cfg.n_layer, seed)
        if hasattr(p, "device_mesh"):  # a DTensor: take this rank's shard of the full value
            from torch.distributed.tensor import distribute_tensor

            local = distribute_tensor(full.to(p.device), p.device_mesh, p.placements, src_data_rank=None).to_local()
            p.to_local().copy_(local)
        else:
            p.copy_(full)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay 2-D weights (matmuls, embeddings); never biases or LayerNorm gains."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
