"""Tokenize and shard: worker-count independence, format, dtype, cache and concurrency."""

import json
import os
import threading

import numpy as np
import pytest

from stoker.config import DataConfig, TokenizerConfig
from stoker.data import prepare as data_prep
from stoker.data import sharding
from stoker.failures import DataError, is_transient
from stoker.storage.shards import materialize, validate_shard_set
from stoker.storage.store import Store
from stoker.training.data import TokenStream

DATA = DataConfig(max_bytes=400_000, val_fraction=0.1, shard_tokens=20_000)


@pytest.fixture
def store(tmp_path):
    return Store("file://" + str(tmp_path / "store"))


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """One downloaded corpus and trained tokenizer, shared by the tests of this module."""
    store = Store("file://" + str(tmp_path_factory.mktemp("prepared") / "store"))
    ds = data_prep.download_dataset(DATA, store)
    tk = data_prep.train_tokenizer(ds, TokenizerConfig(vocab_size=400), store)
    return store, ds, tk


def _copy_inputs(src_store, store, ds, tk):
    """A prepared dataset (its info and parts) and tokenizer, copied into another store."""
    from stoker.storage.datasets import dataset_parts

    parts = [p.key for p in dataset_parts(src_store, ds.fingerprint)]
    for key in (*parts, f"{ds.key}/info.json", tk.key):
        store.write_bytes(key, src_store.read_bytes(key))


def _files(store, shards):
    folder = store.local_path(shards.key)
    return {n: open(os.path.join(folder, n), "rb").read() for n in sorted(os.listdir(folder))}


def test_shards_are_byte_identical_whatever_the_worker_count(prepared):
    store, ds, tk = prepared
    one = data_prep.tokenize_and_shard(ds, tk, DATA.model_copy(update={"num_workers": 1}), store)
    reference = _files(store, one)
    store.rm(one.key)
    # three worker processes, each owning every third of many small partitions
    three = data_prep.tokenize_and_shard(
        ds, tk, DATA.model_copy(update={"num_workers": 3}), store, partition_bytes=48_000
    )
    assert not three.cache_hit and three.cache_key == one.cache_key
    assert _files(store, three) == reference
    manifest = json.loads(reference["manifest.json"])
    assert len(manifest["splits"]["train"]) > 3  # several shard files, cut across partitions
    again = data_prep.tokenize_and_shard(ds, tk, DATA.model_copy(update={"num_workers": 2}), store)
    assert again.cache_hit and again.cache_key == one.cache_key  # worker count is not in the key


def test_shards_decode_back_to_every_document_in_order(prepared):
    from tokenizers import Tokenizer

    store, ds, tk = prepared
    shards = data_prep.tokenize_and_shard(
        ds, tk, DATA.model_copy(update={"num_workers": 2}), store, partition_bytes=64_000
    )
    folder = store.local_path(shards.key)
    manifest = json.loads(open(os.path.join(folder, "manifest.json")).read())
    tok = Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
    decoded = {"train": [], "val": []}
    for split, names in manifest["splits"].items():
        for name in names:
            tokens = np.fromfile(os.path.join(folder, name), dtype=manifest["dtype"])
            ends = np.fromfile(os.path.join(folder, name.replace(".bin", ".idx")), dtype="<u8")
            entry = manifest["files"][name]
            assert entry["tokens"] == len(tokens) == ends[-1] and entry["docs"] == len(ends)
            assert entry["size"] == os.path.getsize(os.path.join(folder, name))
            assert (tokens[ends - 1] == tk.eot_id).all()
            starts = np.concatenate([np.zeros(1, ends.dtype), ends[:-1]])
            decoded[split] += [tok.decode(tokens[s : e - 1].tolist()) for s, e in zip(starts.tolist(), ends.tolist())]
    docs = list(data_prep.iter_corpus(store, ds))
    expected_val = [d for d in docs if sharding.is_val(d, DATA.val_fraction)]
    assert decoded["val"] == expected_val and decoded["train"] == [d for d in docs if d not in expected_val]
    assert manifest["num_docs"] == {"train": len(decoded["train"]), "val": len(expected_val)}
    assert set(manifest["inputs"]) == {"dataset_fingerprint", "tokenizer_sha256", "params"}
    assert manifest["cache_key"] == shards.cache_key and manifest["format_version"] >= 2


def test_partitions_take_each_line_exactly_once(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    docs = [f"doc {i} " + "x" * (i % 37) for i in range(300)]
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    size = corpus.stat().st_size
    for step in (1, 7, 64, 1000, size, size + 10):
        got = []
        for start in range(0, size, step):
            got += list(sharding._partition_docs(str(corpus), start, min(start + step, size)))
        assert got == docs, step


def _big_vocab_tokenizer(path, extra):
    """A byte-level BPE whose vocabulary holds `extra` unused tokens (no merges)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab["<|endoftext|>"] = len(vocab)
    for i in range(extra):
        vocab[f"unused{i}"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path))
    return len(vocab)


def test_vocab_too_large_for_uint16_fails_before_work_and_auto_uses_uint32(store, tmp_path):
    (tmp_path / "c.txt").write_text("".join(f"document {i}: some text for the corpus.\n\n" * 40 for i in range(60)))
    vocab = _big_vocab_tokenizer(tmp_path / "big.json", 70_000)
    data = DataConfig(source=str(tmp_path / "c.txt"), val_fraction=0.2, token_dtype="uint16")
    ds = data_prep.download_dataset(data, store)
    with pytest.raises(DataError, match="tokenizer.vocab_size: the tokenizer has 70257 ids"):
        data_prep.train_tokenizer(ds, TokenizerConfig(path=str(tmp_path / "big.json")), store)
    tk = data_prep.train_tokenizer(ds, TokenizerConfig(path=str(tmp_path / "big.json"), vocab_size=vocab), store)
    assert tk.vocab_size == vocab > 2**16
    with pytest.raises(DataError, match=r"data.token_dtype: uint16 holds token ids below 65536.*'uint32' or 'auto'"):
        data_prep.tokenize_and_shard(ds, tk, data, store)
    assert store.listdir("shards") == []
    shards = data_prep.tokenize_and_shard(ds, tk, data.model_copy(update={"token_dtype": "auto"}), store)
    assert shards.dtype == "<u4"
    stream = TokenStream(store.local_path(shards.key), "train")
    assert stream.vocab_size == vocab and stream.num_tokens == shards.num_train_tokens


def test_explicit_uint32_changes_the_key_and_the_bytes(prepared):
    store, ds, tk = prepared
    small = data_prep.tokenize_and_shard(ds, tk, DATA.model_copy(update={"token_dtype": "uint16"}), store)
    wide = data_prep.tokenize_and_shard(ds, tk, DATA.model_copy(update={"token_dtype": "uint32"}), store)
    assert (small.dtype, wide.dtype) == ("<u2", "<u4") and small.cache_key != wide.cache_key
    a = np.fromfile(os.path.join(store.local_path(small.key), "train-00000.bin"), dtype="<u2")
    b = np.fromfile(os.path.join(store.local_path(wide.key), "train-00000.bin"), dtype="<u4")
    assert np.array_equal(a, b)


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_concurrent_runs_with_the_same_key_both_succeed(backend, tmp_path, request, prepared):
    src_store, ds, tk = prepared
    if backend == "s3":
        root, options = request.getfixturevalue("s3_root")
        store = Store(root, options)
    else:
        store = Store("file://" + str(tmp_path / "store"))
    _copy_inputs(src_store, store, ds, tk)
    data = DATA.model_copy(update={"num_workers": 1})
    results, errors = [], []

    def run():
        try:
            results.append(data_prep.tokenize_and_shard(ds, tk, data, store))
        except BaseException as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(results) == 2
    assert results[0].cache_key == results[1].cache_key
    assert validate_shard_set(store, results[0].cache_key, deep=True)
    assert store.listdir("shards") == [results[0].cache_key]  # no staging left behind
    if backend == "local":  # the build lock: the second run waited and found the first one's set
        assert sorted(r.cache_hit for r in results) == [False, True]


def test_dead_build_leftovers_are_cleared_and_a_damaged_set_rebuilt(prepared, tmp_path):
    src_store, ds, tk = prepared
    store = Store("file://" + str(tmp_path / "store"))
    _copy_inputs(src_store, store, ds, tk)
    first = data_prep.tokenize_and_shard(ds, tk, DATA, store)
    store.write_bytes(f"shards/.tmp-{first.cache_key}-deadbeef/train-00000.bin", b"partial")
    path = os.path.join(store.local_path(first.key), "val-00000.idx")
    with open(path, "r+b") as f:  # same size, one flipped byte: only the checksum sees it
        f.seek(3)
        byte = f.read(1)
        f.seek(3)
        f.write(bytes([byte[0] ^ 0x01]))
    assert not validate_shard_set(store, first.cache_key, deep=True)
    with pytest.raises(DataError, match="val-00000.idx fails its sha256"):  # where the bytes land
        materialize(store, first.cache_key, str(tmp_path / "host"))
    again = data_prep.tokenize_and_shard(ds, tk, DATA, store)  # the marker: rebuilt
    assert not again.cache_hit and validate_shard_set(store, first.cache_key, deep=True)
    assert store.listdir("shards") == [first.cache_key]


def test_shards_on_an_object_store_match_the_local_ones(prepared, s3_root):
    src_store, ds, tk = prepared
    root, options = s3_root
    store = Store(root, options)
    _copy_inputs(src_store, store, ds, tk)
    remote = data_prep.tokenize_and_shard(
        ds, tk, DATA.model_copy(update={"num_workers": 2}), store, partition_bytes=100_000
    )
    local = data_prep.tokenize_and_shard(ds, tk, DATA, src_store)
    assert remote.cache_key == local.cache_key
    manifest = store.read_json(f"{remote.key}/manifest.json")
    for name, entry in manifest["files"].items():
        assert store.sha256(f"{remote.key}/{name}") == entry["sha256"]
    assert manifest == src_store.read_json(f"{local.key}/manifest.json")
    assert store.listdir("shards") == [remote.cache_key]
    assert data_prep.tokenize_and_shard(ds, tk, DATA, store).cache_hit


def test_a_failing_worker_stops_the_build_with_a_transient_error(tmp_path, prepared):
    store, _, tk = prepared
    store.get_file(tk.key, str(tmp_path / "tokenizer.json"))
    missing = str(tmp_path / "no-such-corpus.jsonl")  # the workers' open() fails: an OSError
    jobs = [
        sharding.PartitionJob(
            k, missing, k * 10, k * 10 + 10, str(tmp_path / "tokenizer.json"), 0, "<u2", 0.1, str(tmp_path / f"p-{k}")
        )
        for k in range(2)
    ]
    with pytest.raises(ChildProcessError, match=r"tokenizer worker 0, partition 0: FileNotFoundError") as err:
        sharding.build_shards(jobs, str(tmp_path), 1024, num_workers=2, work_dir=str(tmp_path))
    assert is_transient(err.value)


def test_split_with_no_document_leaves_nothing(store, tmp_path):
    (tmp_path / "one.txt").write_text("only one short document")
    data = DataConfig(source=str(tmp_path / "one.txt"), val_fraction=0.01)
    ds = data_prep.download_dataset(data, store)
    tk = data_prep.train_tokenizer(ds, TokenizerConfig(vocab_size=300), store)
    with pytest.raises(DataError, match="data.val_fraction: the val split got no document"):
        data_prep.tokenize_and_shard(ds, tk, data, store)
    assert store.listdir("shards") == []


def test_val_fraction_holds_by_tokens_for_one_huge_document(store, tmp_path):
    """One 2 MB document among small ones: the val split gets val_fraction of the tokens (it
    got all or none of the document's when documents were split whole)."""
    import random

    rng = random.Random(7)
    words = ["alpha", "beta", "gamma", "delta", "stoker", "tokens", "split", "fraction"]
    huge = " ".join(rng.choice(words) for _ in range(330_000))  # ~2 MB, one document
    small = [f"small document {i}: " + " ".join(rng.choice(words) for _ in range(40)) for i in range(200)]
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": d}) + "\n" for d in [huge, *small]))
    data = DataConfig(source=str(corpus), val_fraction=0.05, shard_tokens=200_000)
    ds = data_prep.download_dataset(data, store)
    tk = data_prep.train_tokenizer(ds, TokenizerConfig(vocab_size=300), store)
    shards = data_prep.tokenize_and_shard(ds, tk, data, store)
    manifest = store.read_json(f"{shards.key}/manifest.json")
    tokens = manifest["num_tokens"]
    share = tokens["val"] / (tokens["val"] + tokens["train"])
    assert abs(share - 0.05) < 0.005, (share, tokens)


def test_pieces_of_a_document_follow_the_fraction_and_one_piece_keeps_its_hash_split():
    for f in (0.01, 0.05, 0.1, 0.5):
        for doc in ("a", "some document", "another one"):
            flags = [sharding.is_val(doc, f, k) for k in range(1000)]
            assert abs(sum(flags) - 1000 * f) <= 1  # any run of pieces: within one piece
            u = sharding._doc_offset(doc)
            assert flags[0] == (u < f)


def test_text_that_spells_a_special_token_stays_text(tmp_path):
    """A document about tokenizers that writes '<|endoftext|>' is one document: the only end
    of text ids in the shards are the ones stoker put after each document (document attention
    would split it at a literal one)."""
    store = Store("file://" + str(tmp_path / "store"))
    src = tmp_path / "docs.jsonl"
    docs = [f"doc {i}: the separator is written <|endoftext|> in the vocabulary file. " * 3 for i in range(60)]
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    data = DataConfig(source=str(src), val_fraction=0.1, num_workers=1)
    ds = data_prep.download_dataset(data, store)
    tk = data_prep.train_tokenizer(ds, TokenizerConfig(vocab_size=400), store)
    shards = data_prep.tokenize_and_shard(ds, tk, data, store)
    manifest = store.read_json(f"{shards.key}/manifest.json")
    stored = np.concatenate(
        [
            np.frombuffer(store.read_bytes(f"{shards.key}/{n}"), "<u2")
            for s in ("train", "val")
            for n in manifest["splits"][s]
        ]
    )
    assert int((stored == tk.eot_id).sum()) == len(docs)  # one per document, none from its text
