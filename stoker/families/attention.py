"""Attention in packed windows, what every family's blocks call: causal attention by SDPA's
kernels (model.attention 'causal'), or within documents (model.attention 'document'): a
``DocumentMask`` made once per forward pass and shared by the blocks, served on CUDA by flex
attention's fused kernel over a BlockMask, elsewhere by SDPA over the exact dense mask.

On CUDA both flex-attention pieces are compiled once per process, as torchtitan does
(``models/attention.py``: ``_compiled_create_block_mask``, ``FlexAttentionWrapper.
_compiled_flex_attn``): the mask builder, and flex_attention itself, made by the first mask
built on CUDA, in the model's forward ahead of its blocks, never inside a block's compile. The
CPU's paths are eager and exact. What flex attention's kernel cannot take (a head under 16 wide,
a torch without it) is refused before launch by the preflight (``preflight.flex_attention_problem``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# the fused kernel wherever CUDA runs; False: the exact path there too (what a CUDA test compares)
FUSED_ON_CUDA = True


class DocumentMask:
    """Document-aware attention over a micro-batch of packed windows (model.attention
    'document'): a token attends to the earlier tokens of its own document only. A document
    ends at (and includes) the separator token; the tokens after it begin the next one.

    Made once per forward pass and shared by every block. On CUDA it holds a flex-attention
    BlockMask (blocks of 128 x 128 positions that are wholly masked are skipped by the fused
    kernel; no T x T tensor exists) and the flex_attention its blocks call (``flex``: compiled
    once per process on CUDA, eager on the CPU); elsewhere the exact (B, 1, T, T) boolean mask
    of scaled_dot_product_attention."""

    def __init__(self, idx: torch.Tensor, end_id: int, fused: bool | None = None):
        """fused: the flex-attention BlockMask (default: on CUDA); else the dense mask."""
        ends = (idx == end_id).to(torch.int32)  # (B, T)
        self.doc = torch.cumsum(ends, dim=1) - ends  # (B, T): separators before each position
        B, T = idx.shape
        self.block = None
        self.dense = None
        self.flex = None
        if (idx.is_cuda and FUSED_ON_CUDA) if fused is None else fused:
            doc = self.doc

            def same_document_causal(b, h, q, kv):
                return (q >= kv) & (doc[b, q] == doc[b, kv])

            self.block = block_mask_builder(idx.is_cuda)(same_document_causal, B, None, T, T, device=idx.device)
            self.flex = flex_attention_kernel(idx.is_cuda)
        else:
            self.dense = self.dense_mask()

    def dense_mask(self) -> torch.Tensor:
        """(B, 1, T, T) bool: True where a query position may attend to a key position."""
        T = self.doc.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=self.doc.device).tril()
        return (causal & (self.doc[:, :, None] == self.doc[:, None, :]))[:, None]


_BUILDER = None


def block_mask_builder(on_cuda: bool = True):
    """flex attention's create_block_mask, compiled once per process on CUDA (torchtitan's
    way), so that the mask is built block by block wherever the forward runs (FSDP2 compiles the
    blocks, not the root's forward where the mask is made): eager, create_block_mask first
    evaluates the mask function over a dense (B, H, T, T) grid, B x T^2 bytes and more (2.6 GB
    at B=4, T=8k on the CPU, 204 MB compiled; `python -m benchmarks.bench_block_mask`). The
    CPU's check of this path (fused=True there) builds it eagerly: compiling it on the CPU costs
    ~45 s of C++ compilation per process, for sizes where the dense grid is small. Inside a
    compiled region (a whole model compiled) the plain function: the enclosing compile
    compiles it, and no torch.compile is made while Dynamo traces."""
    from torch.nn.attention.flex_attention import create_block_mask

    global _BUILDER
    if not on_cuda or torch.compiler.is_compiling():
        return create_block_mask
    if _BUILDER is None:
        _BUILDER = torch.compile(create_block_mask)
    return _BUILDER


_FLEX = None


def flex_attention_kernel(on_cuda: bool = True):
    """The flex_attention a DocumentMask's blocks call. On CUDA one torch.compile of it per
    process (torchtitan's ``FlexAttentionWrapper._compiled_flex_attn``), made by the first mask,
    ahead of the blocks: blocks compiled on their own inline it as one object, and uncompiled
    blocks run its fused kernel (eager flex attention on CUDA would materialize the scores). On
    the CPU the eager function: the exact check of this path. Inside a compiled region the plain
    function, which the enclosing compile lowers to the same fused kernel."""
    from torch.nn.attention.flex_attention import flex_attention

    global _FLEX
    if not on_cuda or torch.compiler.is_compiling():
        return flex_attention
    if _FLEX is None:
        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: "DocumentMask | None", dropout_p: float, enable_gqa: bool
) -> torch.Tensor:
    """Causal attention of q (B, nh, T, hd) over k, v (B, nkv, T, hd), within documents when
    `mask` is given; (B, nh, T, hd). Without a mask: SDPA's causal kernels (today's numerics)."""
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout_p, enable_gqa=enable_gqa)
    if mask.block is not None and dropout_p == 0.0:
        return mask.flex(q, k, v, block_mask=mask.block, enable_gqa=enable_gqa)
    dense = mask.dense if mask.dense is not None else mask.dense_mask()  # attention dropout: the exact path
    return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, dropout_p=dropout_p, enable_gqa=enable_gqa)


def attention_mask(model, idx: torch.Tensor) -> "DocumentMask | None":
    """The mask a model's forward shares among its blocks: None under model.attention
    'causal'; a DocumentMask at the model's ``document_end_id`` under 'document'."""
    if getattr(model.cfg, "attention", "causal") != "document":
        return None
    end_id = getattr(model, "document_end_id", None)
    if end_id is None:
        raise ValueError(
            "model.attention 'document' needs the id of the token that ends each document: set the model's "
            "document_end_id (the shards' eot_id) after building it"
        )
    return DocumentMask(idx, end_id)
