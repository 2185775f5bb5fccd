"""Evaluation sets beyond the validation loss: bits per byte of held-out text, and
multiple-choice scoring (HellaSwag-style completion ranking) over stoker's vendored set.

Both score the model's distribution over the tokenizer's ids: the logits of the padded
embedding rows (model.vocab_pad_multiple; never a target) are left out of the softmax, as in
the model training.export writes, so these numbers equal transformers' on that folder. Bits
per byte count bytes exactly for byte-level BPE and SentencePiece byte-fallback tokenizers
(token_byte_counts) and are refused for any other (BitsPerByteUnsupported).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch
import torch.nn.functional as F

from stoker.arithmetic.token_bytes import BitsPerByteUnsupported, token_byte_counts  # noqa: F401 (re-exported)
from stoker.failures import DataError

EVALSETS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "evalsets")
MULTIPLE_CHOICE_FILE = os.path.join(EVALSETS_DIR, "stdlib-continuations.jsonl")
# the sha256 of the vendored file, checked at every load (scripts/build_evalset.py rebuilds it)
MULTIPLE_CHOICE_SHA256 = "e33850159fc7994efe528156517cddea1d82896ce5df05447da74937b90db704"


# ---- bits per byte (the bytes of each token id: arithmetic.token_bytes) ----------------------------
@dataclass
class HeldOut:
    """Sums over the predicted tokens of held-out windows."""

    nll: float = 0.0  # nats, every predicted token
    num_tokens: int = 0
    counted_nll: float = 0.0  # nats, the predicted tokens that stand for text (no special tokens)
    num_bytes: int = 0

    @property
    def loss(self) -> float:
        return self.nll / max(self.num_tokens, 1)

    @property
    def bits_per_byte(self) -> float | None:
        return self.counted_nll / (math.log(2) * self.num_bytes) if self.num_bytes else None


def token_nll(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, autocast: Callable[[], ContextManager]):
    """(B, T) float32: -log p(y[b, t] | x[b, :t+1]) over the tokenizer's ids."""
    with autocast():
        logits = model(x)[0]  # (B, T, V): the padded rows left out
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten(), reduction="none").view(y.shape)


def add_window_scores(
    into: HeldOut, nll: torch.Tensor, y: torch.Tensor, byte_counts: torch.Tensor | None, x: torch.Tensor | None = None
) -> None:
    """Add a batch of windows: nll and y (B, T), the targets (a window's first token is never
    one: it has no prediction), and x (B, T) the tokens before them, which byte counts of
    shape (3, V) need (token_byte_counts: a tokenizer with a dummy prefix). Bits per byte
    count only the targets' bytes, and leave the special targets (the end-of-text; they
    count no bytes) out of both sums, as nanochat's evaluate_bpb does."""
    into.nll += float(nll.double().sum())
    into.num_tokens += y.numel()
    if byte_counts is None:
        return
    if byte_counts.dim() == 1:
        nbytes = byte_counts[y]  # (B, T)
        counted = nbytes > 0
    else:
        if x is None:
            raise TypeError(
                "add_window_scores: these byte counts depend on the token before each target (the "
                "tokenizer's dummy prefix): pass the windows' inputs x"
            )
        bytes_of, starts_with_prefix, prefixed_after = byte_counts
        counted = bytes_of[y] > 0
        nbytes = bytes_of[y] - starts_with_prefix[y] * prefixed_after[x]
    into.counted_nll += float((nll.double() * counted).sum())
    into.num_bytes += int(nbytes.sum())


# ---- multiple choice --------------------------------------------------------------------------
MULTIPLE_CHOICE_TASK = "stoker_mc"  # the set's name to data.decontaminate (stoker.data.evalitems.VENDORED_TASK)


@dataclass(frozen=True)
class ChoiceItem:
    context: str
    endings: tuple[str, ...]
    label: int
    source: str = ""
    id: int | None = None  # its number in the set ("stoker_mc:ID" to data.decontaminate)


def load_multiple_choice(
    path: str = MULTIPLE_CHOICE_FILE, sha256: str = MULTIPLE_CHOICE_SHA256, limit: int | None = None
) -> list[ChoiceItem]:
    """The first `limit` items of a multiple-choice JSON-lines file whose sha256 must be
    `sha256` (DataError otherwise). A first line {"meta": ...} tells how it was built."""
    with open(path, "rb") as f:
        data = f.read()
    got = hashlib.sha256(data).hexdigest()
    if got != sha256:
        raise DataError(
            f"the multiple-choice set {path} has sha256 {got}, not the {sha256} this stoker ships: "
            "it was changed or damaged. Reinstall stoker, or rebuild it with python scripts/build_evalset.py "
            "(and put its new sha256 in stoker.training.scoring.MULTIPLE_CHOICE_SHA256)."
        )
    items = []
    for line in data.decode("utf-8").splitlines():
        record = json.loads(line)
        if "meta" in record:
            continue
        items.append(
            ChoiceItem(
                record["context"], tuple(record["endings"]), int(record["label"]), record["source"], record.get("id")
            )
        )
        if limit is not None and len(items) == limit:
            break
    return items


@dataclass
class ChoiceRows:
    """An item as token rows: per ending, context + ending ids fitted into the model's
    context, and how many of the last ids are the ending's."""

    rows: list[list[int]]
    num_ending: list[int]
    label: int


def encode_items(tokenizer, items: list[ChoiceItem], block_size: int) -> list[ChoiceRows]:
    """Context and each ending tokenized apart and joined (llm.c's hellaswag.py does the same).
    A row is at most block_size + 1 ids (the model sees all but the last): the context is cut
    from the left; an ending longer than block_size keeps its first block_size ids after one
    context id."""
    out = []
    for item in items:
        ctx = tokenizer.encode(item.context, add_special_tokens=False).ids
        rows, ends = [], []
        for ending in item.endings:
            end = tokenizer.encode(ending, add_special_tokens=False).ids[:block_size]
            keep = min(len(ctx), block_size + 1 - len(end))
            assert keep >= 1, f"item {item.source!r} has no context: its first ending token would have no prediction"
            rows.append(ctx[len(ctx) - keep :] + end)
            ends.append(len(end))
        out.append(ChoiceRows(rows, ends, item.label))
    return out


@dataclass
class ChoiceScores:
    logprob: torch.Tensor  # (N, K) float64: the sum of each ending's tokens' log-probabilities
    num_tokens: torch.Tensor  # (N, K) int64
    labels: torch.Tensor  # (N,)

    @property
    def predictions(self) -> torch.Tensor:
        """acc's choice: the highest log-likelihood (the lowest summed loss)."""
        return self.logprob.argmax(dim=1)

    @property
    def predictions_norm(self) -> torch.Tensor:
        """acc_norm's choice: the lowest mean per-token loss."""
        return (self.logprob / self.num_tokens).argmax(dim=1)

    @property
    def accuracy(self) -> float:
        return float((self.predictions == self.labels).double().mean())

    @property
    def accuracy_norm(self) -> float:
        return float((self.predictions_norm == self.labels).double().mean())

    def subset(self, keep: torch.Tensor) -> "ChoiceScores":
        """The scores of the items where `keep` (N,) bool is true (a clean subset)."""
        return ChoiceScores(self.logprob[keep], self.num_tokens[keep], self.labels[keep])


@torch.no_grad()
def score_choices(
    model: torch.nn.Module,
    items: list[ChoiceRows],
    device: torch.device,
    autocast: Callable[[], ContextManager] = nullcontext,
    items_per_batch: int = 16,
) -> ChoiceScores:
    """Each ending's log-likelihood given its context, items_per_batch items (all their
    endings) per forward pass, right-padded: causal attention never looks at the padding."""
    sums, counts = [], []
    for start in range(0, len(items), items_per_batch):
        batch = [
            (row, n) for item in items[start : start + items_per_batch] for row, n in zip(item.rows, item.num_ending)
        ]
        width = max(len(row) for row, _ in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width - 1), dtype=torch.bool)
        for b, (row, n) in enumerate(batch):
            ids[b, : len(row)] = torch.tensor(row)
            mask[b, len(row) - 1 - n : len(row) - 1] = True  # the positions that predict the ending
        ids, mask = ids.to(device), mask.to(device)
        x, y = ids[:, :-1], ids[:, 1:]  # (R, L-1)
        with autocast():
            logits = model(x)[0]  # (R, L-1, V)
        logprobs = F.log_softmax(logits.float(), dim=-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
        sums.append((logprobs.double() * mask).sum(dim=1).cpu())
        counts.append(mask.sum(dim=1).cpu())
    k = len(items[0].rows) if items else 0
    return ChoiceScores(
        logprob=torch.cat(sums).view(-1, k) if sums else torch.zeros(0, k, dtype=torch.float64),
        num_tokens=torch.cat(counts).view(-1, k) if counts else torch.zeros(0, k, dtype=torch.long),
        labels=torch.tensor([item.label for item in items], dtype=torch.long),
    )
