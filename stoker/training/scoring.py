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
import re
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, ContextManager

import numpy as np
import torch
import torch.nn.functional as F

from stoker.core.failures import DataError

EVALSETS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "evalsets")
MULTIPLE_CHOICE_FILE = os.path.join(EVALSETS_DIR, "stdlib-continuations.jsonl")
# the sha256 of the vendored file, checked at every load (scripts/build_evalset.py rebuilds it)
MULTIPLE_CHOICE_SHA256 = "e33850159fc7994efe528156517cddea1d82896ce5df05447da74937b90db704"


# ---- bits per byte --------------------------------------------------------------------------
class BitsPerByteUnsupported(ValueError):
    """The tokenizer's tokens cannot be counted in bytes exactly: bits per byte is refused
    rather than computed wrong."""


def _refuse(why: str) -> BitsPerByteUnsupported:
    return BitsPerByteUnsupported(
        "eval.sets: bits per byte is exact only for byte-level BPE and SentencePiece byte-fallback "
        f"tokenizers; {why}; remove 'bpb' from eval.sets"
    )


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the printable character that stands for each byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


_SEQUENCE_KEYS = {"normalizer": "normalizers", "pre_tokenizer": "pretokenizers", "decoder": "decoders"}
_BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")  # SentencePiece's byte-fallback pieces
_KEEPS_TEXT_PRE_TOKENIZERS = {"Split", "Digits", "Punctuation", "UnicodeScripts"}  # split, never drop


def _parts(spec: dict, kind: str) -> list[dict]:
    """The components of a tokenizer.json section, a Sequence flattened ([] for none)."""
    c = spec.get(kind)
    if not c:
        return []
    if c.get("type") == "Sequence":
        return [p for sub in c.get(_SEQUENCE_KEYS[kind], []) for p in _parts({kind: sub}, kind)]
    return [c]


def _describe(spec: dict, kind: str) -> str:
    parts = _parts(spec, kind)
    if not parts:
        return "none"
    names = [p.get("type", "?") for p in parts]
    return names[0] if len(names) == 1 else f"Sequence[{', '.join(names)}]"


@dataclass(frozen=True)
class _Scheme:
    """How a tokenizer's pieces stand for bytes."""

    byte_level: bool  # pieces are GPT-2 byte characters; else SentencePiece-style with byte fallback
    space: str | None  # the character that stands for a space in the pieces (SentencePiece's "▁")
    prefix: str | None  # the character a dummy prefix puts before a document's text (None: no prefix)
    every_segment: bool  # the prefix goes before each text segment between added tokens, not the first only


def _scheme(spec: dict) -> _Scheme:
    """The byte scheme of a tokenizer.json, or BitsPerByteUnsupported naming what is not exact."""
    model = spec.get("model") or {}
    mtype = model.get("type")
    decoders = [d.get("type") for d in _parts(spec, "decoder")]
    normalizers = _parts(spec, "normalizer")
    pre_tokenizers = _parts(spec, "pre_tokenizer")
    byte_level = bool(decoders) and set(decoders) == {"ByteLevel"}
    fallback = bool(decoders) and set(decoders) <= {"Replace", "ByteFallback", "Fuse", "Strip", "Metaspace"}
    if byte_level:
        if mtype != "BPE":
            raise _refuse(f"this tokenizer's decoder is ByteLevel but its model is {mtype}, not BPE")
        if not any(p.get("type") == "ByteLevel" for p in pre_tokenizers + normalizers):
            raise _refuse("this tokenizer's decoder is ByteLevel but it has no ByteLevel pre-tokenizer")
    elif fallback:
        if mtype not in ("BPE", "Unigram") or not model.get("byte_fallback"):
            raise _refuse(
                f"this tokenizer's decoder is {_describe(spec, 'decoder')} but its {mtype} model has no byte "
                "fallback: text it cannot spell becomes <unk>, whose bytes are lost"
            )
    else:
        raise _refuse(f"this tokenizer's decoder is {_describe(spec, 'decoder')} ({mtype} model)")
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        raise _refuse(f"this tokenizer's {mtype} model marks word pieces with text that is not in the text")

    space = prefix = None
    every_segment = False
    for n in normalizers:
        t = n.get("type")
        if t == "NFC":  # the counts are of the text in NFC, as most text already is
            continue
        if t == "ByteLevel" and byte_level:
            continue
        if not byte_level and t == "Replace" and n.get("pattern") == {"String": " "} and len(n.get("content", "")) == 1:
            space = n["content"]
            continue
        if not byte_level and t == "Prepend" and prefix is None:
            prefix, every_segment = n.get("prepend"), True  # before every segment, even one that starts with a space
            continue
        raise _refuse(f"this tokenizer's normalizer ({_describe(spec, 'normalizer')}) changes the text at {t}")
    for k, p in enumerate(pre_tokenizers):
        t = p.get("type")
        if t in _KEEPS_TEXT_PRE_TOKENIZERS and p.get("behavior") != "Removed":
            continue
        scheme = None
        if t == "ByteLevel" and byte_level:
            scheme, mark = ("always" if p.get("add_prefix_space") else "never"), _bytes_to_unicode()[ord(" ")]
        elif t == "Metaspace" and not byte_level and space in (None, p.get("replacement")):
            scheme = p.get("prepend_scheme") or ("always" if p.get("add_prefix_space", True) else "never")
            space = mark = p.get("replacement")
        if scheme is None:
            raise _refuse(
                f"this tokenizer's pre-tokenizer ({_describe(spec, 'pre_tokenizer')}) drops or changes text at {t}"
            )
        if scheme != "never":
            if prefix is not None or (scheme == "always" and k > 0):
                # after another splitter, 'always' puts a prefix before every word, not before the text
                raise _refuse(f"this tokenizer's pre-tokenizer {t} puts spaces that are not in the text between words")
            prefix, every_segment = mark, scheme == "always"
    if prefix is not None and prefix != (space if not byte_level else _bytes_to_unicode()[ord(" ")]):
        raise _refuse(f"this tokenizer puts {prefix!r} before the text, which is not its space character {space!r}")
    return _Scheme(byte_level, space, prefix, every_segment)


def _document_start(spec: dict) -> int | None:
    """The id the post-processor puts right before a document's text (a bos), if any."""
    post = spec.get("post_processor") or {}
    for p in post.get("processors", []) if post.get("type") == "Sequence" else [post]:
        single = p.get("single", []) if p.get("type") == "TemplateProcessing" else []
        at = next((k for k, item in enumerate(single) if "Sequence" in item), 0)
        if at > 0 and "SpecialToken" in single[at - 1]:
            return int(p["special_tokens"][single[at - 1]["SpecialToken"]["id"]]["ids"][-1])
    return None


def token_byte_counts(tokenizer, vocab_size: int) -> np.ndarray:
    """How many bytes of the text each id stands for: (vocab_size,) int64, or (3, vocab_size)
    when that depends on the token before (a tokenizer that puts a dummy prefix before a
    document's text). Raises BitsPerByteUnsupported for a tokenizer whose tokens cannot be
    counted exactly. Summed over a document's ids the counts give its UTF-8 length.

    Byte-level BPE (GPT-2's, Llama 3's, Qwen2's): each character of a piece stands for one
    byte, so a piece that holds part of a character counts the bytes it holds.
    SentencePiece-style with byte fallback (Llama 2's, Mistral's): a piece counts the UTF-8
    bytes of its text, its "▁" one space each; a byte piece <0xHH> counts 1.
    Special tokens (the end-of-text, a bos, <unk>) count 0, and so do ids the tokenizer lacks
    and pieces that no text encodes to.

    The dummy prefix: SentencePiece writes a document "Hi" as "▁Hi", a space that is not in
    the text. The document-start token the post-processor puts before each document (the bos,
    "<s>") tells where: a piece that follows it and starts with "▁" counts one byte less. Its
    rows then: [0] the bytes of the id, [1] 1 where the id starts with the prefix character,
    [2] 1 where an id is followed by a prefixed segment (the bos, and added tokens when the
    prefix goes before every segment). A target y after the token x counts
    counts[0, y] - counts[1, y] * counts[2, x] bytes (add_window_scores). Not the end-of-text:
    a document longer than a shard piece (data.sharding.PIECE_TOKENS) goes on after another
    document's end-of-text without a prefix. A tokenizer with a prefix and no bos is refused.

    The bytes are those of the text the tokenizer keeps: a normalizer NFC counts the text's
    NFC form; a Metaspace pre-tokenizer prefixes a document only when it does not start with
    a space, so a document's leading space is its prefix and counts 0 (decode drops it too);
    text that spells a special token (a literal "</s>") is encoded as that token, which counts
    0, and a dummy prefix the tokenizer puts after it (or not) may be miscounted by its byte."""
    spec = json.loads(tokenizer.to_str())
    scheme = _scheme(spec)
    space_char = _bytes_to_unicode()[ord(" ")] if scheme.byte_level else scheme.space
    counts = np.zeros((3, vocab_size), dtype=np.int64)  # bytes, starts with the prefix, followed by a prefix
    added = {t["id"]: t for t in spec.get("added_tokens", [])}
    for i, t in added.items():
        if i >= vocab_size or t.get("special"):
            continue
        if t.get("normalized") and (spec.get("normalizer") or scheme.prefix):
            raise _refuse(f"its added token {t['content']!r} is matched in the normalized text, not in the text")
        if t.get("lstrip") or t.get("rstrip"):
            raise _refuse(f"its added token {t['content']!r} swallows the spaces next to it")
        counts[0, i] = len(t["content"].encode("utf-8"))
        counts[2, i] = int(scheme.every_segment)
    if scheme.byte_level:
        alphabet = _bytes_to_unicode()
        lacking = [b for b, c in alphabet.items() if tokenizer.token_to_id(c) is None]
        chars = set(alphabet.values())
    else:
        lacking = [b for b in range(256) if tokenizer.token_to_id(f"<0x{b:02X}>") in added.keys() | {None}]
    if lacking:
        raise _refuse(f"its vocabulary lacks byte {lacking[0]:#04x}: text with that byte would be lost")
    if scheme.prefix is not None:
        start = _document_start(spec)
        if start is None:
            raise _refuse(
                f"it puts {scheme.prefix!r} before a document's text, a space that is not in the text, and no "
                "document-start token (bos) before a document to tell where"
            )
        if tokenizer.token_to_id(scheme.prefix) is None:
            raise _refuse(f"it puts {scheme.prefix!r} before a document's text but its vocabulary lacks it")
        if start < vocab_size:
            counts[2, start] = 1
    for i in range(vocab_size):
        piece = tokenizer.id_to_token(i)
        if piece is None or i in added:
            continue
        if scheme.byte_level:
            n = len(piece) if all(c in chars for c in piece) else 0  # else no text encodes to it
        elif _BYTE_TOKEN.fullmatch(piece):
            n = 1
        else:
            n = len((piece.replace(space_char, " ") if space_char else piece).encode("utf-8"))
        counts[0, i] = n
        counts[1, i] = int(n > 0 and scheme.prefix is not None and piece.startswith(scheme.prefix))
    return counts if scheme.prefix is not None else counts[0].copy()


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
@dataclass(frozen=True)
class ChoiceItem:
    context: str
    endings: tuple[str, ...]
    label: int
    source: str = ""


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
        items.append(ChoiceItem(record["context"], tuple(record["endings"]), int(record["label"]), record["source"]))
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
