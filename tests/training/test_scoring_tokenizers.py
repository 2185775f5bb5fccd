"""Bits per byte with open base models' tokenizers (training.scoring.token_byte_counts): exact
for byte-level BPE (Llama 3's, Qwen2's) and SentencePiece-style BPE with byte fallback (Llama
2's, Mistral's: the dummy prefix "▁" before each document is no byte of the text), refused
with its reason for any other. The tokenizers are built here with `tokenizers`, as their
tokenizer.json files describe them; the token streams are cut as data.sharding writes them."""

import json
import random
import re

import numpy as np
import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from stoker.training.scoring import BitsPerByteUnsupported, HeldOut, add_window_scores, token_byte_counts

TEXT = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.\n"
    "Naïve café owners in Zürich serve crème brûlée; the façade of the château is déjà vu.\n"
    "日本語のテキストを少し書きます。東京は大きな都市です。中文也可以：我们在学习。\n"
    "Emoji travel too: 😀 🎉 🚀 and 👩‍💻 writes code; math: ∑ x² ≥ 0, π ≈ 3.14159, ½ + ¼.\n"
    "def main():\n    for i in range(10):\n        print(i, i ** 2)  # squares\n\treturn None\n"
    "Привет, мир! Ελληνικά γράμματα. עברית מימין לשמאל. हिन्दी भी।\n"
) * 8

DOCS = [
    "Hello world.",
    " Hello world with a leading space.",
    "  two leading spaces and a trailing one ",
    "\nA document that starts with a newline.\n\nAnd has paragraphs.\n",
    "multiple   spaces\tand\ttabs\r\nand CRLF",
    "Naïve café — 日本語のテキスト 😀🎉 and unseen ones: 🦀 Ω ß ǅ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "def f(x):\n    return x ** 2  # ≥ 0\n",
    "",
    " ",
    "\n",
    "😀",
    "Привет, мир! Ελληνικά. עברית. हिन्दी।",
    "The end of the text. " * 30,
]

LLAMA3_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"


def _byte_of() -> dict[str, int]:
    """GPT-2's byte alphabet, from transformers (not stoker's copy)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


def _byte_level(add_prefix_space: bool = False, split: bool = True, alphabet: bool = True) -> Tokenizer:
    """Llama 3's pipeline (split=True): Split(regex) + ByteLevel without its regex, a ByteLevel
    decoder, <|begin_of_text|> put before each text by the post-processor."""
    tok = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=add_prefix_space, use_regex=not split)
    if split:
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(LLAMA3_SPLIT), "isolated"), byte_level])
    else:
        tok.pre_tokenizer = byte_level
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet() if alphabet else [],
        show_progress=False,
    )
    tok.train_from_iterator([TEXT], trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", bos)]),
        ]
    )
    return tok


def _sentencepiece(style: str, bos: bool = True) -> Tokenizer:
    """Llama 2's pipeline (style "prepend": normalizer Prepend("▁") + Replace(" ", "▁")), its
    newer tokenizer.json form ("metaspace": a Metaspace pre-tokenizer, prepend_scheme 'first'),
    or Gemma's ("replace": Replace only, no dummy prefix). BPE with byte fallback: <unk>, <s>,
    </s>, then the 256 byte pieces <0x00>..<0xFF>, then the trained pieces; a small alphabet so
    that rare characters fall back to bytes."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    if style == "prepend":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    elif style == "replace":
        tok.normalizer = normalizers.Replace(" ", "▁")
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    specials = ["<unk>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials, limit_alphabet=60, show_progress=False)
    tok.train_from_iterator([TEXT], trainer)
    trained = json.loads(tok.to_str())["model"]
    vocab = {s: i for i, s in enumerate(specials)} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in trained["vocab"]:
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(m) for m in trained["merges"]]
    tok.model = models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True)
    tok.add_special_tokens(specials)
    strip = [decoders.Strip(" ", 1, 0)] if style != "replace" else []
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


# name: (builder, end-of-text, whether a document's leading space is the tokenizer's prefix)
TOKENIZERS = {
    "llama3-byte-level": (lambda: _byte_level(), "<|end_of_text|>", False),
    "gpt2-byte-level-prefix": (lambda: _byte_level(add_prefix_space=True, split=False), "<|end_of_text|>", True),
    "llama2-prepend": (lambda: _sentencepiece("prepend"), "</s>", False),
    "llama2-metaspace": (lambda: _sentencepiece("metaspace"), "</s>", True),
    "gemma-no-prefix": (lambda: _sentencepiece("replace"), "</s>", False),
}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def built(request):
    make, eot, lossy_space = TOKENIZERS[request.param]
    tok = make()
    return request.param, tok, tok.token_to_id(eot), lossy_space


def _stream(tok: Tokenizer, eot: int, docs: list[str]) -> tuple[list[int], list[int]]:
    """The documents as data.sharding writes them (each one's ids, default special tokens,
    then the end-of-text), after one end-of-text; and where each document starts."""
    ids, starts = [eot], []
    for enc in tok.encode_batch(docs):
        starts.append(len(ids))
        ids.extend(enc.ids + [eot])
    return ids, starts


def _reference_bytes(tok: Tokenizer, name: str, docs: list[str], eot: int) -> list[bytes]:
    """Per position of the stream, the bytes its token stands for, rebuilt from the pieces
    document by document (the dummy prefix: the first byte of a document's first piece)."""
    byte_of = _byte_of()
    special = {t["id"] for t in json.loads(tok.to_str())["added_tokens"] if t["special"]}
    out = [b""]
    for enc in tok.encode_batch(docs):
        parts = []
        for i in enc.ids:
            piece = tok.id_to_token(i)
            if i in special:
                parts.append(b"")
            elif "byte-level" in name:
                parts.append(bytes(byte_of[c] for c in piece))
            elif m := re.fullmatch(r"<0x([0-9A-F]{2})>", piece):
                parts.append(bytes([int(m[1], 16)]))
            else:
                parts.append(piece.replace("▁", " ").encode("utf-8"))
        if "gemma" not in name and "llama3" not in name:  # a dummy prefix: the first text piece's space
            first = next(k for k, p in enumerate(parts + [b"-"]) if p)
            if first < len(parts):
                assert parts[first][:1] == b" "
                parts[first] = parts[first][1:]
        out.extend(parts + [b""])
    return out


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _score(counts: np.ndarray, ids: list[int], windows: list[tuple[int, int]]) -> HeldOut:
    """add_window_scores over windows [a, b) of the stream of equal length (a batch, as
    evaluate.held_out_scores cuts them), every prediction 1 nat."""
    held = HeldOut()
    rows = torch.tensor([ids[a:b] for a, b in windows])
    x, y = rows[:, :-1], rows[:, 1:]
    add_window_scores(held, torch.ones(y.shape), y, torch.from_numpy(counts), x)
    return held


def _expected(doc: str, lossy_space: bool) -> int:
    """A document's UTF-8 length; less the leading space the tokenizer takes for its prefix."""
    return len(doc.encode("utf-8")) - int(lossy_space and doc.startswith(" "))


def test_the_bytes_of_a_stream_of_documents_add_up_to_their_utf8_length(built):
    name, tok, eot, lossy_space = built
    V = tok.get_vocab_size()
    counts = token_byte_counts(tok, V)
    prefixed = name not in ("llama3-byte-level", "gemma-no-prefix")
    assert counts.shape == ((3, V) if prefixed else (V,))
    bytes_of = counts[0] if prefixed else counts
    specials = [t["id"] for t in json.loads(tok.to_str())["added_tokens"] if t["special"]]
    assert bytes_of[specials].tolist() == [0] * len(specials) and eot in specials
    if "byte-level" not in name:  # the byte pieces count one byte each, the space marker one
        assert bytes_of[[tok.token_to_id(f"<0x{b:02X}>") for b in range(256)]].tolist() == [1] * 256
        assert bytes_of[tok.token_to_id("▁")] == 1
    ids, starts = _stream(tok, eot, DOCS)
    assert any(re.fullmatch(r"<0x..>", tok.id_to_token(i)) for i in ids) or "byte-level" in name  # fell back
    decoded = [tok.decode(enc.ids) for enc in tok.encode_batch(DOCS)]
    expected = [_expected(d, lossy_space) for d in DOCS]
    if "prefix" not in name:  # the byte-level prefix's decoder keeps the space it added
        assert [len(d.encode("utf-8")) for d in decoded] == expected  # the text the tokens stand for

    # the whole stream: its first token (an end-of-text) is never predicted
    held = _score(counts, ids, [(0, len(ids))])
    assert held.num_bytes == sum(expected)
    assert held.counted_nll == sum(i not in specials for i in ids[1:])  # special targets left out

    # every window cut at document boundaries: from the end-of-text before document k to the
    # end-of-text of document m - 1
    ends = starts[1:] + [len(ids)]
    for k in range(len(DOCS)):
        for m in range(k + 1, len(DOCS) + 1):
            held = _score(counts, ids, [(starts[k] - 1, ends[m - 1])])
            assert held.num_bytes == sum(expected[k:m]), (name, k, m)

    # the reference per position, rebuilt from the pieces, spells the documents byte for byte
    ref = _reference_bytes(tok, name, DOCS, eot)
    assert len(ref) == len(ids)
    if "byte-level" in name:  # tokens that hold part of a character
        assert any(not _is_utf8(b) for b in ref)
    for k, doc in enumerate(DOCS):
        text = b"".join(ref[starts[k] : ends[k]])
        assert text == (doc[1:] if lossy_space and doc.startswith(" ") else doc).encode("utf-8"), (name, k)


def test_random_windows_of_a_split_count_the_bytes_of_their_targets(built):
    """A split as data.sharding writes it: each document's ids and end-of-text cut in pieces
    (of PIECE_TOKENS; 7 here), some pieces kept, so a document's later piece follows another
    document's end-of-text with no prefix before it. Windows cut anywhere, in batches: each
    target counts the bytes its token stands for in its document."""
    name, tok, eot, _ = built
    counts = token_byte_counts(tok, tok.get_vocab_size())
    rng = random.Random(0)
    docs = [rng.choice(DOCS) for _ in range(60)]
    ids, starts = _stream(tok, eot, docs)
    ref = [len(b) for b in _reference_bytes(tok, name, docs, eot)]
    pieces = [
        (ids[s : min(s + 7, end)], ref[s : min(s + 7, end)])
        for start, end in zip(starts, starts[1:] + [len(ids)])
        for s in range(start, end, 7)
    ]
    kept = [p for p in pieces if rng.random() < 0.5]
    assert any(p[0][0] not in (eot, tok.token_to_id("<s>"), tok.token_to_id("<|begin_of_text|>")) for p in kept)
    ids = [eot] + [i for p, _ in kept for i in p]
    ref = [0] + [n for _, r in kept for n in r]
    specials = {t["id"] for t in json.loads(tok.to_str())["added_tokens"] if t["special"]}
    for _ in range(200):
        T = rng.randint(1, 40)
        windows = [(a, a + T + 1) for a in (rng.randrange(len(ids) - T) for _ in range(rng.randint(1, 6)))]
        held = _score(counts, ids, windows)
        assert held.num_bytes == sum(sum(ref[a + 1 : b]) for a, b in windows), (name, windows)
        assert held.counted_nll == sum(i not in specials for a, b in windows for i in ids[a + 1 : b])
    held = _score(counts, ids, [(0, len(ids))])
    assert held.num_bytes == sum(ref)


def test_a_metaspace_decoder_counts_the_same():
    tok = _sentencepiece("metaspace")
    counts = token_byte_counts(tok, tok.get_vocab_size())
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    assert np.array_equal(token_byte_counts(tok, tok.get_vocab_size()), counts)
    # ids past the tokenizer's (the padded embedding rows) count nothing
    wider = token_byte_counts(tok, tok.get_vocab_size() + 5)
    assert wider.shape == (3, tok.get_vocab_size() + 5) and not wider[:, -5:].any()


def test_byte_counts_that_depend_on_the_token_before_need_the_inputs():
    tok = _sentencepiece("prepend")
    counts = torch.from_numpy(token_byte_counts(tok, tok.get_vocab_size()))
    y = torch.tensor([[tok.token_to_id("▁")]])
    with pytest.raises(TypeError, match="pass the windows' inputs x"):
        add_window_scores(HeldOut(), torch.ones(1, 1), y, counts)
    held = HeldOut()
    add_window_scores(held, torch.ones(2, 1), torch.cat([y, y]), counts, torch.tensor([[1], [y.item()]]))
    assert held.num_bytes == 1 and held.counted_nll == 2  # after <s> the prefix; after "▁" a space


def _wordpiece() -> Tokenizer:
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator([TEXT], trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]"]))
    return tok


def _unigram() -> Tokenizer:
    tok = Tokenizer(models.Unigram())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=200, special_tokens=["<unk>"], unk_token="<unk>", show_progress=False)
    tok.train_from_iterator([TEXT], trainer)
    return tok


@pytest.mark.parametrize(
    "make, reason",
    [
        (_wordpiece, r"decoder is WordPiece"),
        (_unigram, r"Unigram model has no byte fallback: text it cannot spell becomes <unk>"),
        (lambda: _sentencepiece("prepend", bos=False), r"no document-start token \(bos\)"),
        (lambda: _byte_level(add_prefix_space=True, split=True), r"spaces that are not in the text between words"),
    ],
    ids=["wordpiece", "unigram-without-byte-fallback", "dummy-prefix-without-bos", "prefix-per-word"],
)
def test_a_tokenizer_whose_bytes_cannot_be_counted_exactly_is_refused_with_the_reason(make, reason):
    tok = make()
    with pytest.raises(BitsPerByteUnsupported, match=reason) as err:
        token_byte_counts(tok, tok.get_vocab_size())
    assert str(err.value).startswith("eval.sets: bits per byte is exact only for byte-level BPE and SentencePiece")
    assert str(err.value).endswith("remove 'bpb' from eval.sets") and isinstance(err.value, ValueError)


def test_the_flow_refuses_such_a_tokenizer_before_launch_unless_bpb_is_left_out(tmp_path):
    """write_run_config (the flow's last step before the launch) asks the shards' tokenizer
    when eval.sets holds 'bpb': one ConfigError with the reason, nothing pinned; without 'bpb'
    the run is pinned."""
    from stoker.config import ConfigError, RunConfig
    from stoker.contracts.results import DataShards, ShardInfo
    from stoker.storage.store import Store
    from stoker.tasks.training import write_run_config

    root = f"file://{tmp_path}/store"
    store = Store(root)
    tok = _wordpiece()
    store.write_bytes("shards/k/tokenizer.json", tok.to_str().encode())
    shards = DataShards([ShardInfo("k", "shards/k", store.url("shards/k"), 1, 1, tok.get_vocab_size(), "<u2", False)])
    cfg = RunConfig.model_validate({"run_name": "wp", "storage": {"root": root}})
    with pytest.raises(ConfigError) as err:
        write_run_config.fn(cfg, shards)
    [line] = err.value.problems
    assert line.startswith("eval.sets: bits per byte is exact only") and "decoder is WordPiece" in line
    assert not store.exists("runs/wp/config.json")
    without = cfg.model_copy(update={"eval": cfg.eval.model_copy(update={"sets": ["loss"]})})
    assert write_run_config.fn(without, shards) == store.url("runs/wp/config.json")


def test_a_vocabulary_lacking_bytes_is_counted_and_refused_only_where_the_data_holds_them(tmp_path):
    """A byte-level BPE trained without the full alphabet lacks the bytes its text never held:
    its tokens are counted all the same (lacking_bytes names what it cannot spell), and the flow
    refuses 'bpb' only when the data stage counted such bytes in a source, with the count and
    the first example; a source without them is pinned."""
    from stoker.arithmetic.token_bytes import lacking_bytes
    from stoker.config import ConfigError, RunConfig
    from stoker.contracts.results import DataShards, ShardInfo
    from stoker.storage.store import Store
    from stoker.tasks.training import write_run_config

    tok = _byte_level(alphabet=False)
    lacking = lacking_bytes(tok)
    assert 0x00 in lacking and 0xFF not in lacking and ord("d") not in lacking  # 0xFF never occurs in UTF-8
    counts = token_byte_counts(tok, tok.get_vocab_size())
    assert counts.ndim == 1 and int(counts[tok.encode(TEXT).ids].sum()) == len(TEXT.encode())  # its text, exactly
    root = f"file://{tmp_path}/store"
    store = Store(root)
    store.write_bytes("shards/k/tokenizer.json", tok.to_str().encode())
    cfg = RunConfig.model_validate({"run_name": "lossy", "storage": {"root": root}})

    def shards(lost: int) -> DataShards:
        info = ShardInfo("k", "shards/k", store.url("shards/k"), 1, 1, tok.get_vocab_size(), "<u2", False)
        info.unencodable_bytes, info.unencodable_example = lost, "byte 0x00 in 'a\\x00b'" if lost else ""
        return DataShards([info])

    with pytest.raises(ConfigError) as err:
        write_run_config.fn(cfg, shards(3))
    assert err.value.problems == [
        "eval.sets: bits per byte would count text the tokenizer drops: 3 byte(s) are ones its vocabulary cannot "
        "encode (first: byte 0x00 in 'a\\x00b'); remove 'bpb' from eval.sets, or clean those bytes from the data"
    ]
    assert not store.exists("runs/lossy/config.json")
    assert write_run_config.fn(cfg, shards(0)) == store.url("runs/lossy/config.json")
