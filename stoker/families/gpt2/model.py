"""The gpt2 family: nanoGPT's GPT (pre-norm blocks, causal self-attention, learned
positions, GELU MLP, tied embeddings), its spec and its Hugging Face adapter (GPT2LMHeadModel).

The embedding and output rows are padded to ``model.vocab_pad_multiple`` (the extra rows are
never a target, so token ids and the loss are unchanged in meaning). The loss is the full
logits' cross-entropy, or the same loss a chunk of tokens at a time (``chunked_cross_entropy``,
engine.cross_entropy: 'chunked'), which never holds the whole (tokens x vocabulary) logits.
Initial weights are a pure function of the seed and each parameter's name (``init_weights``),
so a model built on the meta device and sharded by FSDP2 starts from the same values as a
replicated one.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from stoker.families.attention import attend, attention_mask
from stoker.families.common import copy_full_value, seeded_generator
from stoker.families.gpt2.config import GPT2Config
from stoker.families.layers import chunked_cross_entropy, logits_and_loss, padded_vocab
from stoker.families.spec import ModelSpec


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.n_head, self.n_embd, self.dropout = cfg.n_head, cfg.n_embd, cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, mask=None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)  # 3 x (B, T, C)
        # (B, nh, T, hs)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = attend(q, k, v, mask, self.dropout if self.training else 0.0, False)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)
        self.approximate = "tanh" if cfg.activation == "gelu_tanh" else "none"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate=self.approximate)))


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, mask=None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPT2Config, vocab_size: int, *, seed: int | None = 0):
        """seed=None leaves the weights uninitialized (meta-device build; see init_weights)."""
        super().__init__()
        self.cfg, self.vocab_size = cfg, vocab_size
        self.loss_chunk = 0  # tokens per chunk of a chunked cross-entropy; 0: the full logits
        self.document_end_id: int | None = None  # the separator of model.attention 'document'
        vocab_size = padded_vocab(vocab_size, cfg.vocab_pad_multiple)
        self.wte = nn.Embedding(vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying
        # the output layer and loss; the engine swaps in a compiled one under FSDP2
        self.output_loss = logits_and_loss
        if seed is not None:
            init_weights(self, seed)

    def num_params(self, embedding: bool = False) -> int:
        """Parameters (the tied output matrix once); without position embeddings unless asked."""
        n = sum(p.numel() for p in self.parameters())
        return n if embedding else n - self.wpe.weight.numel()

    def flops_per_token(self) -> float:
        """Training FLOPs per token, as the plan counts them (the section's ``flops_per_token``:
        6N + 12·L·C·T, N without position embeddings)."""
        return self.cfg.flops_per_token(self.wte.weight.shape[0])

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        B, T = idx.shape
        pos = torch.arange(T, device=idx.device)
        mask = attention_mask(self, idx)  # None: causal; once per micro-batch for every block
        x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.blocks:
            x = block(x) if mask is None else block(x, mask)
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
    # scaled init of residual projections (GPT-2)
    std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("c_proj.weight") else 0.02
    return torch.empty(shape).normal_(0.0, std, generator=seeded_generator(seed, name))


@torch.no_grad()
def init_weights(model: GPT, seed: int) -> None:
    """Set every parameter to its initial value. Works on plain and FSDP2-sharded (DTensor)
    parameters alike: each rank fills only its own shard, with no communication."""
    for name, p in model.named_parameters():
        copy_full_value(p, _init_value(name, p.shape, model.cfg.n_layer, seed))


# ---- the Hugging Face adapter (GPT2LMHeadModel) ------------------------------------------------
# Our GPT is GPT-2's architecture with differences the adapter makes exact: Linear weights are
# (out, in) and GPT-2's Conv1D weights (in, out), so they are transposed; under model.bias:
# false the biases GPT-2 always has are zeros (the same function); the embedding is padded to
# model.vocab_pad_multiple rows and only the tokenizer's rows are exported (a row's logit depends
# on that row alone); the position table holds block_size rows (a base's longer one is cut).
_BLOCK_PARAMS = [  # (ours, GPT-2's, transpose)
    ("ln_1.weight", "ln_1.weight", False),
    ("ln_1.bias", "ln_1.bias", False),
    ("attn.c_attn.weight", "attn.c_attn.weight", True),
    ("attn.c_attn.bias", "attn.c_attn.bias", False),
    ("attn.c_proj.weight", "attn.c_proj.weight", True),
    ("attn.c_proj.bias", "attn.c_proj.bias", False),
    ("ln_2.weight", "ln_2.weight", False),
    ("ln_2.bias", "ln_2.bias", False),
    ("mlp.c_fc.weight", "mlp.c_fc.weight", True),
    ("mlp.c_fc.bias", "mlp.c_fc.bias", False),
    ("mlp.c_proj.weight", "mlp.c_proj.weight", True),
    ("mlp.c_proj.bias", "mlp.c_proj.bias", False),
]


def hf_map(cfg: GPT2Config) -> list[tuple[str, str, bool]]:
    """Every tensor of ours with its GPT2LMHeadModel name and whether it is transposed."""
    out = [("wte.weight", "transformer.wte.weight", False), ("wpe.weight", "transformer.wpe.weight", False)]
    for i in range(cfg.n_layer):
        out += [
            (f"blocks.{i}.{mine}", f"transformer.h.{i}.{theirs}", transpose)
            for mine, theirs, transpose in _BLOCK_PARAMS
            if cfg.bias or not mine.endswith(".bias")
        ]
    out += [("ln_f.weight", "transformer.ln_f.weight", False)]
    return out + ([("ln_f.bias", "transformer.ln_f.bias", False)] if cfg.bias else [])


def _zero_biases(cfg: GPT2Config, state: dict) -> dict:
    """GPT-2's biases under model.bias: false: zeros, the same function."""
    if cfg.bias:
        return {}
    C = cfg.n_embd
    widths = {"ln_1": C, "attn.c_attn": 3 * C, "attn.c_proj": C, "ln_2": C, "mlp.c_fc": 4 * C, "mlp.c_proj": C}
    out = {f"transformer.h.{i}.{m}.bias": torch.zeros(w) for i in range(cfg.n_layer) for m, w in widths.items()}
    return {**out, "transformer.ln_f.bias": torch.zeros(C)}


def vocab_rows(cfg: GPT2Config, vocab_size: int) -> int:
    return padded_vocab(vocab_size, cfg.vocab_pad_multiple)


SPEC = ModelSpec(
    family="gpt2",
    build=lambda cfg, vocab_size, seed: GPT(cfg, vocab_size, seed=seed),
    blocks=lambda model: list(model.blocks),
    init_weights=lambda model, seed: init_weights(model, seed),
    flops_per_token=lambda model: model.flops_per_token(),
    vocab_rows=vocab_rows,
    hf_map=hf_map,
    hf_extra_to=_zero_biases,
    hf_tied=lambda cfg: {"lm_head.weight": "transformer.wte.weight"},
)
