"""How many UTF-8 bytes each token id of a tokenizer stands for: what bits per byte divides by
(training.scoring). Torch-free, so the flow can refuse a tokenizer it cannot count exactly
before any rank starts (tasks.training.write_run_config), and the evaluation counts with the
same function.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np


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
    # bytes the vocabulary cannot spell are not refused here: the data stage counts them in
    # the text itself (``lacking_bytes``), and the flow refuses 'bpb' only where it found some
    chars = set(_bytes_to_unicode().values())
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


def bits_per_byte_problem(tokenizer_json: bytes, vocab_size: int, unencodable: dict | None = None) -> str | None:
    """Why bits per byte cannot be counted exactly with this tokenizer.json on this data, or
    None: what the flow asks before a run with 'bpb' in eval.sets launches (its evaluation
    would refuse it only after the first checkpoint). `unencodable`: {source: (bytes, first
    example)} of the text the vocabulary cannot spell, as the data stage counted it
    (``lacking_bytes``); only a source where it found some is refused."""
    from tokenizers import Tokenizer

    try:
        token_byte_counts(Tokenizer.from_str(tokenizer_json.decode()), vocab_size)
    except BitsPerByteUnsupported as err:
        return str(err)
    lost = {name: found for name, found in (unencodable or {}).items() if found and found[0]}
    if lost:
        name, (count, example) = next(iter(lost.items()))
        where = f" in source {name!r}" if name else ""
        return (
            f"eval.sets: bits per byte would count text the tokenizer drops: {count} byte(s){where} are ones its "
            f"vocabulary cannot encode (first: {example}); remove 'bpb' from eval.sets, or clean those bytes "
            "from the data"
        )
    return None


# bytes that never occur in UTF-8 text: a vocabulary may lack them at no cost
NEVER_IN_UTF8 = frozenset([0xC0, 0xC1, *range(0xF5, 0x100)])


def lacking_bytes(tokenizer) -> list[int]:
    """The byte values that can occur in UTF-8 text and that the tokenizer's vocabulary cannot
    spell (a byte-level BPE without that byte's character, a byte-fallback model without its
    <0xHH> piece): text holding one of them is dropped or becomes <unk> when tokenized. []
    for a tokenizer of neither kind (it is not counted in bytes at all)."""
    spec = json.loads(tokenizer.to_str())
    decoders = {d.get("type") for d in _parts(spec, "decoder")}
    if decoders == {"ByteLevel"}:
        lacking = [b for b, c in _bytes_to_unicode().items() if tokenizer.token_to_id(c) is None]
    elif decoders and "ByteFallback" in decoders:
        added = {t["id"] for t in spec.get("added_tokens", [])}
        lacking = [b for b in range(256) if tokenizer.token_to_id(f"<0x{b:02X}>") in added | {None}]
    else:
        return []
    return sorted(b for b in lacking if b not in NEVER_IN_UTF8)


def byte_table(lacking: list[int]) -> np.ndarray | None:
    """(256,) bool, True at each lacking byte; None when there is none (nothing to count)."""
    if not lacking:
        return None
    table = np.zeros(256, dtype=bool)
    table[lacking] = True
    return table


def count_unencodable(text: str, table: np.ndarray) -> tuple[int, str]:
    """(how many bytes of `text` the table marks, an example: the first one with the text
    around it), (0, '') for none."""
    raw = text.encode("utf-8", "surrogatepass")
    hits = table[np.frombuffer(raw, dtype=np.uint8)]
    n = int(hits.sum())
    if not n:
        return 0, ""
    at = int(np.argmax(hits))
    around = raw[max(0, at - 20) : at + 20].decode("utf-8", "replace")
    return n, f"byte {raw[at]:#04x} in {around!r}"
