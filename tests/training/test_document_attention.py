"""Document-aware attention (model.attention 'document'; families.attention.DocumentMask):
a token of a packed window attends only to the earlier tokens of its own document, the
boundaries at the separator token (which ends, and belongs to, its document).

For the RoPE families a document inside a packed window has the logits it has alone (RoPE
depends only on relative positions): checked against transformers on each document alone, at
assert_close defaults, for Llama 3.2, Qwen2, Mistral and a SmolLM2-like shape (grouped-query
attention 6/2 with an explicit head_dim of 24, not 96 / 6). The fused path (flex attention
with a BlockMask, what CUDA runs) equals the exact CPU path; eager flex attention runs here."""

from __future__ import annotations

import pytest
import torch

from stoker.families.attention import DocumentMask, attend
from stoker.families.gpt2.config import GPT2Config
from stoker.families.gpt2.model import GPT
from tests.training.test_llama import _SHAPE, STYLES, _from_base, _hf_model

transformers = pytest.importorskip("transformers")

SEP = 7  # the separator id of these tests (a document's last token)
VOCAB = 300


def _chat_config():
    """SmolLM2-like: GQA 6/2 heads, an explicit head_dim (24) that is not hidden / heads (16)."""
    shape = {**_SHAPE, "hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 2}
    return transformers.LlamaConfig(**shape, head_dim=24, rope_theta=1e5, rms_norm_eps=1e-5, tie_word_embeddings=True)


CONFIGS = {**STYLES, "chat": _chat_config}


def _hf(style: str):
    return _hf_model(style, CONFIGS)


def packed(batch: int = 2, length: int = 32, seed: int = 3) -> torch.Tensor:
    """(batch, length) windows packed from documents of 3-14 tokens, each ended by SEP; the first
    and last documents of a window cut by its edges, as a packed training window is."""
    g = torch.Generator().manual_seed(seed)
    flat: list[int] = []
    while len(flat) < batch * length + 5:
        doc = torch.randint(0, VOCAB, (int(torch.randint(3, 15, (1,), generator=g)),), generator=g)
        doc[doc == SEP] = SEP + 1
        flat += doc.tolist() + [SEP]
    return torch.tensor(flat[5 : 5 + batch * length]).view(batch, length)


def segments(row: torch.Tensor) -> list[tuple[int, int]]:
    """[start, end) of each document of a window (a separator ends its document)."""
    ends = [i + 1 for i, t in enumerate(row.tolist()) if t == SEP]
    starts = [0] + ends
    return [(s, e) for s, e in zip(starts, ends + [len(row)]) if e > s]


@pytest.mark.parametrize("style", list(CONFIGS))
def test_a_document_in_a_packed_window_has_the_logits_it_has_alone(style):
    hf = _hf(style)
    ours, cfg = _from_base(hf, VOCAB)
    idx = packed()
    with torch.no_grad():
        causal = ours(idx)[0]
        cfg.attention = "document"
        ours.document_end_id = SEP
        masked = ours(idx)[0]
        for b in range(idx.shape[0]):
            parts = segments(idx[b])
            assert len(parts) >= 3
            for s, e in parts:
                torch.testing.assert_close(masked[b, s:e], hf(idx[b : b + 1, s:e]).logits[0])
            # causal attention reads across the boundary: a later document's logits are not its own
            s, e = parts[1]
            assert not torch.allclose(causal[b, s:e], masked[b, s:e], atol=1e-4)
        torch.testing.assert_close(causal[:, : parts[0][1]], masked[:, : parts[0][1]])  # the first: the same


@pytest.mark.filterwarnings("ignore:.*flex_attention.*")
def test_the_fused_block_mask_path_equals_the_exact_path():
    """What CUDA runs (flex attention over a BlockMask; eager here) against the dense mask,
    with grouped-query attention, on windows whose documents straddle the 128-position blocks."""
    torch.manual_seed(0)
    idx = packed(batch=2, length=256, seed=5)
    q, k, v = torch.randn(2, 6, 256, 24), torch.randn(2, 2, 256, 24), torch.randn(2, 2, 256, 24)
    fused, exact = DocumentMask(idx, SEP, fused=True), DocumentMask(idx, SEP, fused=False)
    assert fused.dense is None and fused.block is not None and exact.block is None
    torch.testing.assert_close(attend(q, k, v, fused, 0.0, True), attend(q, k, v, exact, 0.0, True))
    # the mask: the separator in its own document, the next token the next one's first
    doc = exact.doc[0].tolist()
    at = idx[0].tolist().index(SEP)
    assert doc[at] == doc[0] and doc[at + 1] == doc[0] + 1


def test_gpt2_masks_alike_and_a_window_of_one_document_is_causal_attention():
    cfg = GPT2Config(n_layer=2, n_head=2, n_embd=32, block_size=32)
    model = GPT(cfg, VOCAB, seed=1).eval()
    idx = packed()
    one = idx.clone()
    one[one == SEP] = SEP + 1  # no boundary: the whole window is one document
    with torch.no_grad():
        causal_one, causal = model(one)[0], model(idx)[0]
        cfg.attention = "document"
        model.document_end_id = SEP
        torch.testing.assert_close(model(one)[0], causal_one)
        masked = model(idx)[0]
    s, e = segments(idx[0])[1]
    assert not torch.allclose(masked[0, s:e], causal[0, s:e], atol=1e-4)


def test_document_attention_without_a_separator_id_is_refused():
    cfg = GPT2Config(n_layer=1, n_head=2, n_embd=32, block_size=32, attention="document")
    with pytest.raises(ValueError, match="document_end_id"):
        GPT(cfg, VOCAB, seed=1)(packed())


def test_the_cuda_mask_is_built_by_a_compiled_builder_and_flex_attention_is_kept_by_selective_checkpointing():
    """On CUDA the BlockMask is built by create_block_mask compiled once per process (eager, it
    first evaluates a dense (B, H, T, T) grid: benchmarks/bench_block_mask measures both), and
    selective activation checkpointing keeps flex attention's output as it keeps SDPA's."""
    from torch.nn.attention.flex_attention import create_block_mask

    from stoker.families import attention, layers

    built = attention.block_mask_builder(on_cuda=True)
    assert built is attention.block_mask_builder(on_cuda=True)  # once per process
    assert getattr(built, "_torchdynamo_orig_callable", None) is create_block_mask  # torch.compile's
    assert attention.block_mask_builder(on_cuda=False) is create_block_mask  # the CPU's exact check: eager
    assert torch.ops.higher_order.flex_attention in layers._KEPT
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default in layers._KEPT


def test_flex_attention_is_compiled_once_per_process_ahead_of_the_blocks_and_eager_on_the_cpu():
    """CUDA's flex_attention is one torch.compile of it per process (torchtitan's class
    attribute), handed to the blocks by the mask, which the model's forward makes before any
    block runs; inside a compiled region, and on the CPU, the plain function (an enclosing
    compile lowers it itself; the CPU's path is the exact eager one)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from stoker.families import attention

    compiled = attention.flex_attention_kernel(on_cuda=True)
    assert compiled is attention.flex_attention_kernel(on_cuda=True)  # one object per process
    assert getattr(compiled, "_torchdynamo_orig_callable", None) is flex_attention
    assert attention.flex_attention_kernel(on_cuda=False) is flex_attention
    mask = DocumentMask(packed(batch=1, length=32), SEP, fused=True)  # the CPU's check of the fused path
    assert mask.flex is flex_attention
    assert DocumentMask(packed(batch=1, length=32), SEP, fused=False).flex is None

    seen = []

    @torch.compile(backend="eager")
    def traced(x):
        seen.append(attention.flex_attention_kernel(on_cuda=True))
        seen.append(attention.block_mask_builder(on_cuda=True))
        return x + 1

    traced(torch.zeros(2))
    assert seen == [flex_attention, create_block_mask]
