"""Pieces the model families share: RMSNorm, rotary position embeddings (RoPE, with Llama 3's
frequency scaling), the SwiGLU MLP, and the seeded, shard-aware parameter init.

Each is computed exactly as transformers computes it (``LlamaRMSNorm``, ``LlamaRotaryEmbedding``
with ``_compute_llama3_parameters``, ``rotate_half``, ``LlamaMLP``), op for op, so a Hugging Face
checkpoint loads with no permutation of its q/k projections and gives the same logits in fp32.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    """Root-mean-square norm with a gain, in fp32 whatever the input dtype (as transformers'
    LlamaRMSNorm: the normalized input is cast back before the gain multiplies it)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()  # (..., C) in fp32: the mean of squares of a bf16 x overflows its precision
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class SwiGLU(nn.Module):
    """The gated MLP of Llama: down(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, dim: int, hidden: int, dropout: float = 0.0):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)))


# ---- rotary position embeddings ----------------------------------------------------------------
def rope_inv_freq(
    head_dim: int,
    theta: float,
    rope_type: str = "default",
    *,
    factor: float | None = None,
    low_freq_factor: float | None = None,
    high_freq_factor: float | None = None,
    original_context: int | None = None,
) -> torch.Tensor:
    """The (head_dim/2,) fp32 inverse frequencies, on the CPU, computed as transformers does
    (``compute_default_rope_parameters``; ``_compute_llama3_parameters`` for 'llama3', which
    divides the low frequencies by ``factor`` and interpolates the middle band)."""
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head width, not {head_dim}")
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(dtype=torch.float)
    inv_freq = 1.0 / (theta ** (steps / head_dim))  # (hd/2,)
    if rope_type == "default":
        return inv_freq
    if rope_type != "llama3":
        raise ValueError(f"rope_type {rope_type!r}: the llama family has 'default' and 'llama3'")
    params = (factor, low_freq_factor, high_freq_factor, original_context)
    if any(p is None for p in params):
        raise ValueError(
            "rope_type 'llama3' needs rope_factor, rope_low_freq_factor, "
            "rope_high_freq_factor and rope_original_context"
        )
    low_freq_wavelen = original_context / low_freq_factor
    high_freq_wavelen = original_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # wavelengths above the low-frequency bound: divided by factor; below the high one: kept
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    # in between: interpolated
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_tables(inv_freq: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (length, head_dim) fp32, for positions 0..length-1 (the frequencies
    repeated over both halves of a head, transformers' rotate_half layout)."""
    pos = torch.arange(length, device=inv_freq.device)
    freqs = pos[:, None].float() * inv_freq.float()  # (T, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the two halves of the last dimension."""
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q (B, nh, T, hd) and k (B, nkv, T, hd) by the tables' first T positions (T, hd).
    The rotation runs in fp32 (a bf16 angle table would lose the position of far tokens) and
    the results take the inputs' dtype; in fp32 it is transformers' apply_rotary_pos_emb."""
    qf, kf = q.float(), k.float()
    q_out = qf * cos + rotate_half(qf) * sin
    k_out = kf * cos + rotate_half(kf) * sin
    return q_out.to(q.dtype), k_out.to(k.dtype)


class Rotary(nn.Module):
    """The cos/sin tables of ``length`` positions, fp32, on the module's device.

    They are plain attributes, not buffers: never in the state dict, never cast by
    ``.to(dtype)``, never broadcast by DDP each forward (it broadcasts every buffer). They are
    computed on the CPU (the same values on every device and every path) and copied to the
    device whenever the module moves: ``_apply`` is what ``.to``, ``.cuda`` and ``to_empty``
    run, so a meta-device build gets real tables from ``to_empty`` (``reset`` does it too)."""

    def __init__(self, inv_freq: torch.Tensor, length: int):
        super().__init__()
        self.inv_freq, self.length = inv_freq.cpu(), length  # (hd/2,) fp32, on the CPU
        self.reset(torch.empty(0).device)  # the default device: meta under a meta build

    def reset(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the tables on ``device`` (their current device by default)."""
        device = torch.device(device) if device is not None else self.cos.device
        if device.type == "meta":
            self.cos = torch.empty(self.length, 2 * len(self.inv_freq), device=device)
            self.sin = torch.empty_like(self.cos)
            return
        cos, sin = rope_tables(self.inv_freq, self.length)  # on the CPU
        self.cos, self.sin = cos.to(device), sin.to(device)

    def _apply(self, fn, recurse: bool = True):
        out = super()._apply(fn, recurse)
        self.reset(fn(torch.empty(0, device=self.cos.device)).device)  # where fn moves tensors
        return out

    def forward(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of the first ``length`` positions, each (length, head_dim)."""
        if length > self.length:
            raise ValueError(f"a sequence of {length} tokens is longer than the context, {self.length}")
        return self.cos[:length], self.sin[:length]


# ---- initial weights ---------------------------------------------------------------------------
def seeded_generator(seed: int, name: str) -> torch.Generator:
    """A CPU generator of (seed, parameter name) alone (the same on every rank and device)."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


@torch.no_grad()
def copy_full_value(p: torch.Tensor, full: torch.Tensor) -> None:
    """Set a parameter to its full (unsharded, CPU) value: a plain tensor is copied, an FSDP2
    DTensor gets only this rank's shard of it, with no communication."""
    if hasattr(p, "device_mesh"):
        from torch.distributed.tensor import distribute_tensor

        local = distribute_tensor(full.to(p.device), p.device_mesh, p.placements, src_data_rank=None).to_local()
        p.to_local().copy_(local)
    else:
        p.copy_(full)
