"""data.dedup and data.decontaminate with real parts: a corpus written here with planted exact
copies (whitespace changed), near copies (two words changed) and documents holding items of
the vendored evaluation set, in two sources; the counts removed are the ones planted, and the
shards of the kept documents are the same bytes on the local engine and on Ray."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import random
import shutil
import sysconfig

import numpy as np
import pytest

from stoker.config import DataConfig, EvalConfig, RayConfig, TokenizerConfig, load_config
from stoker.data import dedup, dedup_units
from stoker.data.evalitems import VENDORED_SET, _vendored_items
from stoker.data.prepare import download_dataset, prepare_all
from stoker.failures import ConfigError
from stoker.storage.datasets import dataset_parts
from stoker.storage.store import Store, join

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")
VOCAB = [f"w{i}" for i in range(3000)]
PLANTED = {"exact_a": 3, "near_a": 2, "eval_a": 2, "cross_b": 2}
POOL = [f"v{i}" for i in range(100_000)]  # distinct words for pairs of a known similarity


def _doc(rng: random.Random, n: int = 300) -> str:
    return " ".join(rng.choice(VOCAB) for _ in range(n))


def _near(rng: random.Random, doc: str) -> str:
    ws = doc.split()
    for i in rng.sample(range(len(ws)), 2):
        ws[i] = "changed"
    return " ".join(ws)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two sources (folders of JSON lines): 'domain' with 40 originals, 3 exact copies (other
    whitespace), 2 near copies and 2 documents holding evaluation items; 'replay' with 20
    originals and 2 copies of domain documents."""
    rng = random.Random(47)
    root = tmp_path_factory.mktemp("dedup-corpus")
    originals = [_doc(rng) for _ in range(40)]
    items = _vendored_items()[:2]
    domain = list(originals)
    domain += ["  " + originals[i].replace(" ", "\n", 5) + "\n" for i in (1, 2, 3)]
    domain += [_near(rng, originals[i]) for i in (4, 5)]
    domain += [_doc(rng, 100) + "\n" + it.text + "\n" + _doc(rng, 100) for it in items]
    replay = [_doc(rng) for _ in range(20)] + [originals[7], originals[8]]
    for name, docs in (("domain", domain), ("replay", replay)):
        (root / name).mkdir()
        half = len(docs) // 2  # two files: duplicates across the files of a source count too
        for k, part in enumerate((docs[:half], docs[half:])):
            (root / name / f"part-{k}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in part))
    return root


def _data(corpus, **kw) -> DataConfig:
    sources = [
        {"name": "domain", "source": str(corpus / "domain")},
        {"name": "replay", "source": str(corpus / "replay")},
    ]
    return DataConfig(sources=kw.pop("sources", sources), val_fraction=0.1, shard_tokens=4096, **kw)


def _dedup(store, data: DataConfig):
    sources = data.source_configs()
    datasets = [download_dataset(cfg, store) for _, _, cfg in sources]
    return dedup.dedup_sources(datasets, [(n, c) for n, _, c in sources], store, EvalConfig())


def test_the_planted_copies_near_copies_and_evaluation_items_are_what_is_removed(corpus, tmp_path):
    store = Store(f"file://{tmp_path}/store")
    domain, replay = (info for _, info in _dedup(store, _data(corpus, dedup="near")))
    # the items' n-grams and 200 characters each side cut out: the rest of each document stays
    assert (domain.num_exact, domain.num_near, domain.num_contaminated, domain.num_cut) == (3, 2, 0, 2)
    assert domain.items == {"stoker_mc:0": 1, "stoker_mc:1": 1} and domain.items_checked == {"stoker_mc": 500}
    assert (replay.num_exact, replay.num_near, replay.num_contaminated) == (2, 0, 0)  # trains once, in domain
    assert (domain.num_docs_out, replay.num_docs_out) == (44, 20)  # each cut document in 2 pieces
    samples = dedup.removed_samples(store, domain)
    assert {s["reason"] for s in samples} == {"exact", "near", "cut"}
    cut = [s for s in samples if s["reason"] == "cut"]
    items = {it.id: it.text for it in _vendored_items()[:2]}
    assert all(
        s["pieces"] == 2 and " ".join(items[s["items"][0]].split()[:13]) in " ".join(s["text"].split()) for s in cut
    )
    kept = [
        json.loads(line)["text"]
        for p in dataset_parts(store, [d for d, _ in _dedup(store, _data(corpus, dedup="near"))][0].fingerprint)
        for line in store.read_bytes(p.key).splitlines()
    ]
    assert not any(" ".join(t.split()[:13]) in " ".join(k.split()) for t in items.values() for k in kept)
    near = [s for s in samples if s["reason"] == "near"]
    assert all(s["kept_source"] == "domain" and 0.8 <= s["similarity"] < 1 for s in near)
    # what a person reads of it: the log line, the report's section, `stoker runs`' column
    from stoker.observe.inspect import removed_summary
    from stoker.observe.report import dedup_line, dedup_markdown
    from stoker.storage.layout import run_file_key

    assert dedup_line(domain).startswith("source 'domain': 47 documents") and (
        "removed 3 exact and 2 near duplicates (data.dedup near); evaluation items found in 2 (0 removed whole, "
        "2 cut in pieces) (stoker_mc:0, stoker_mc:1)" in dedup_line(domain)
    )
    section = dedup_markdown([domain, replay], "file:///x/dedup-removed.jsonl")
    assert (
        "| domain | near | 47 |" in section
        and "| 3 | 2 | 0 | 2 | 2 | 44 |" in section
        and "| 2 | 0 | 0 | 0 | 0 | 20 |" in section
    )
    assert "stoker_mc: 2 of 500 (stoker_mc:0, stoker_mc:1)" in section and "file:///x/dedup-removed.jsonl" in section
    store.write_json(run_file_key("r", "shards.json"), {"dedup": [domain.as_dict(), replay.as_dict()]})
    assert removed_summary(store, "r") == "exact 5, near 2, eval 0 removed 2 cut (items found: stoker_mc 2)"


def test_exact_mode_keeps_near_copies_and_a_high_threshold_keeps_them_too(corpus, tmp_path):
    store = Store(f"file://{tmp_path}/store")
    exact = _dedup(store, _data(corpus, dedup="exact"))[0][1]
    strict = _dedup(store, _data(corpus, dedup="near", near_dup_threshold=0.99))[0][1]
    assert (exact.num_exact, exact.num_near) == (3, 0) and (strict.num_exact, strict.num_near) == (3, 0)
    none = _dedup(store, _data(corpus, dedup="none", decontaminate=False))[0][1]
    assert none.num_removed == 0 and none.num_docs_out == none.num_docs_in == 47


def test_a_rerun_is_a_cache_hit_and_an_added_source_is_deduplicated_against_the_first(corpus, tmp_path, monkeypatch):
    store = Store(f"file://{tmp_path}/store")
    data = _data(corpus, dedup="near")
    one = _dedup(store, data.model_copy(update={"sources": data.sources[:1]}))
    assert not one[0][1].cache_hit
    computed = []  # the partitions whose features are computed (not read from the store)
    real = dedup_units._features
    monkeypatch.setattr(
        dedup_units, "_features", lambda store, folder, *a: computed.append(folder) or real(store, folder, *a)
    )
    both = _dedup(store, data)
    assert both[0][1].cache_hit and both[0][0].fingerprint == one[0][0].fingerprint  # read, not redone
    assert not both[1][1].cache_hit and both[1][1].num_exact == 2  # the copies of domain documents
    assert len(computed) == 1  # only the added source's features
    again = _dedup(store, data)
    assert all(info.cache_hit for _, info in again) and len(computed) == 1


def _not_the_sets_standard_library(meta: dict) -> str | None:
    """Why this Python's standard library is not the one the vendored set was cut from (its meta
    record names the Python version and the sha256 of each file), or None where it is."""
    running = platform.python_version()
    if running != meta["python"]:
        return f"the vendored set was made with Python {meta['python']}'s standard library; this is Python {running}"
    stdlib = sysconfig.get_paths()["stdlib"]
    for name, digest in meta["files"].items():
        path = os.path.join(stdlib, name)
        if not os.path.isfile(path) or hashlib.sha256(open(path, "rb").read()).hexdigest() != digest:
            return f"this Python {running}'s {name} is not the one the vendored set was cut from"
    return None


def test_the_decontamination_test_runs_only_on_the_standard_library_the_set_was_cut_from():
    """The exact item missing below is a fact of those files' bytes: on another Python the test
    is skipped, not passed or failed by accident (the control: another version, another file)."""
    meta = json.loads(open(VENDORED_SET).readline())["meta"]
    assert "made with Python 3.0.1's" in _not_the_sets_standard_library({**meta, "python": "3.0.1"})
    name = next(iter(meta["files"]))
    changed = {**meta, "python": platform.python_version(), "files": {**meta["files"], name: "0" * 64}}
    assert name in _not_the_sets_standard_library(changed)


def test_decontamination_finds_the_items_of_the_vendored_set_in_their_source_files(tmp_path):
    """What a run with data.max_bytes 0 reads of the standard library: the files the set was
    cut from. Every item is found but one, whose passage the document split cuts in two at a
    blank line (no 13 words of it in one document)."""
    meta = json.loads(open(VENDORED_SET).readline())["meta"]
    reason = _not_the_sets_standard_library(meta)
    if reason:
        pytest.skip(reason)
    src = tmp_path / "src"
    src.mkdir()
    for name in meta["files"]:
        shutil.copy(os.path.join(sysconfig.get_paths()["stdlib"], name), src / name)
    store = Store(f"file://{tmp_path}/store")
    cfg = DataConfig(source=str(src), max_bytes=0)
    info = dedup.dedup_sources([download_dataset(cfg, store)], [("main", cfg)], store, EvalConfig())[0][1]
    assert set(f"stoker_mc:{i}" for i in range(500)) - set(info.items) == {"stoker_mc:200"}
    assert info.num_contaminated + info.num_cut > 0 and info.items_checked == {"stoker_mc": 500}


@pytest.mark.parametrize(
    "data, field",
    [
        ({"near_dup_threshold": 0}, "data.near_dup_threshold"),
        ({"near_dup_threshold": 1.01}, "data.near_dup_threshold"),
        ({"decontaminate_ngram": 4}, "data.decontaminate_ngram"),
        ({"near_dup_ngram": 3}, "data.near_dup_ngram"),
        ({"dedup": "fuzzy"}, "data.dedup"),
        ({"partition_bytes": 0}, "data.partition_bytes"),
        ({"partition_bytes": 1 << 20}, "data.partition_bytes"),  # below a document's hard cut
    ],
)
def test_a_bad_dedup_setting_is_one_line_naming_the_field(data, field):
    with pytest.raises(ConfigError) as err:
        load_config({"data": data})
    lines = [line for line in str(err.value).splitlines() if line.strip().startswith("-")]
    assert len(lines) == 1 and lines[0].strip().startswith(f"- {field}:")


def test_decontaminate_with_no_evaluation_set_is_refused_before_any_work_only_where_asked(tmp_path):
    """true with nothing to check against is refused, per source too; left empty it is true
    where the run scores an evaluation set and false where it scores none (nothing to refuse)."""
    for data in (
        {"decontaminate": True},
        {"sources": [{"name": "web", "source": "builtin:stdlib", "decontaminate": True}]},
    ):
        with pytest.raises(ConfigError, match="data.decontaminate: is true, and the run scores no evaluation set"):
            load_config({"eval": {"sets": ["loss"]}, "data": data})
    assert load_config({"eval": {"sets": ["loss"]}, "data": {"decontaminate": False}})
    cfg = load_config({"eval": {"sets": ["loss"]}})
    assert cfg.data.decontaminate is None and dedup.checked_items([cfg.data], cfg.eval) is None
    assert dedup.checked_items([load_config({}).data], load_config({}).eval)  # the default sets: the vendored items


# ---- the shards of the kept documents, locally and on Ray ------------------------------------
def _shards(store, data):
    shards = prepare_all(data, TokenizerConfig(vocab_size=300), store, evaluation=EvalConfig())
    files = {}
    for s in shards.sets:
        manifest = store.read_json(join(s.key, "manifest.json"))
        files.update({f"{s.name}/{n}": store.read_bytes(join(s.key, n)) for n in manifest["files"]})
    return shards, files


@pytest.mark.e2e
@needs_ray
@pytest.mark.ray_instance  # one Ray on this machine at a time
def test_a_local_ray_instance_removes_the_same_documents_and_gives_the_same_shard_bytes(corpus, tmp_path):
    local, local_files = _shards(Store(f"file://{tmp_path}/a"), _data(corpus, dedup="near"))
    remote, remote_files = _shards(Store(f"file://{tmp_path}/b"), _data(corpus, dedup="near", engine="ray"))
    assert [d.as_dict() | {"key": 0, "cache_hit": 0} for d in remote.dedup] == [
        d.as_dict() | {"key": 0, "cache_hit": 0} for d in local.dedup
    ]
    assert remote_files == local_files and remote.cache_key == local.cache_key


@pytest.mark.e2e
@needs_ray
def test_two_ray_nodes_remove_the_same_documents_and_give_the_same_shard_bytes(ray_cluster, corpus, tmp_path, caplog):
    local, local_files = _shards(Store(f"file://{tmp_path}/a"), _data(corpus, dedup="near"))
    caplog.set_level("INFO", logger="stoker.data")
    root, options = ray_cluster.bucket()
    ray = RayConfig(address=ray_cluster.cluster.client_address)
    data = _data(corpus, dedup="near", engine="ray")
    store = Store(root, options)
    shards = prepare_all(data, TokenizerConfig(vocab_size=300), store, ray=ray, evaluation=EvalConfig())
    files = {}
    for s in shards.sets:
        manifest = store.read_json(join(s.key, "manifest.json"))
        files.update({f"{s.name}/{n}": store.read_bytes(join(s.key, n)) for n in manifest["files"]})
    assert [(d.num_exact, d.num_near, d.num_cut) for d in shards.dedup] == [(3, 2, 2), (2, 0, 0)]
    assert files == local_files
    # the dedup units ran on both nodes (each stage's tasks spread over the cluster)
    nodes = {n for r in caplog.records if getattr(r, "ray_stage", "").startswith("dedup") for n in r.ray_nodes}
    assert len(nodes) == 2, [(r.ray_stage, r.ray_nodes) for r in caplog.records if hasattr(r, "ray_stage")]


# ---- the units' decision against a brute-force reading of the rule ---------------------------------
def _reference(sources: list[tuple[list[str], dict]], threshold: float, items, max_docs: int = 10) -> list[list[str]]:
    """The rule read literally, every pair compared: a document of a decontaminating source
    whose counting matches (an item's n-gram held by at most `max_docs` documents of those
    sources) leave no piece, or more than 10, is removed ('contaminated'); else it is cut but
    deduplicated as any ('cut' when kept); else removed when an earlier kept document has its
    digest (dedup exact or near), else when an earlier kept one shares a band of its MinHash
    signature and reaches the threshold."""
    from collections import Counter

    from stoker.data import minhash

    num_bands, rows = minhash.bands(threshold)
    index = minhash.EvalIndex(items, 13)
    feats = [minhash.features_of(iter(docs), 5, index if cfg["decontaminate"] else None) for docs, cfg in sources]
    counts = Counter(g for f in feats for m in f.matches.values() for g in {sp[0] for sp in m["spans"] if sp[0]})
    kept, reasons = [], []  # kept: (digest, signature)
    for (docs, cfg), f in zip(sources, feats):
        out = []
        for k in range(len(docs)):
            digest, sig = f.digests[k].tobytes(), f.signatures[k]
            m = f.matches.get(k, {"len": 0, "spans": []})
            spans = [(a, b) for g, _, a, b in m["spans"] if g is None or counts[g] <= max_docs]
            if spans and minhash.pieces(m["len"], spans) is None:
                out.append("contaminated")
            elif cfg["dedup"] != "none" and any(d == digest for d, _ in kept):
                out.append("exact")
            elif cfg["dedup"] == "near" and any(
                minhash.share_a_band(s[None], sig[None], num_bands, rows)[0] and float(np.mean(s == sig)) >= threshold
                for _, s in kept
            ):
                out.append("near")
            else:
                out.append("cut" if spans else "kept")
                kept.append((digest, sig))
        reasons.append(out)
    return reasons


def test_the_units_decide_as_every_pair_compared_across_partitions_buckets_and_mixed_settings(tmp_path, monkeypatch):
    """Chains of near copies (each a few words from a common original, so a copy may match a
    removed one only), exact copies with other whitespace, evaluation items, three sources with
    mixed settings, cut into many partitions and buckets: the units remove exactly what the
    literal rule removes, for the same reasons (the removed documents' numbers compared)."""
    rng = random.Random(5)
    vocab = VOCAB[:400]
    base = [" ".join(rng.choice(vocab) for _ in range(rng.randint(20, 120))) for _ in range(60)]
    items = _vendored_items()[:3]

    def doc() -> str:
        r, d = rng.random(), rng.choice(base)
        if r < 0.4:
            ws = d.split()
            for i in rng.sample(range(len(ws)), min(len(ws), rng.randint(1, 12))):
                ws[i] = rng.choice(vocab)
            d = " ".join(ws)
        elif r < 0.44:  # the first item, in more than 10 documents: its n-grams are common, none counts
            d = "x " + items[0].text
        elif r < 0.47:  # another, amid enough text to keep pieces (or too little: removed whole)
            d = " ".join(rng.choice(vocab) for _ in range(rng.choice([20, 120])))
            d += " " + rng.choice(items[1:]).text + " " + " ".join(rng.choice(vocab) for _ in range(len(d.split())))
        elif r < 0.6:
            d = " ".join(rng.choice(vocab) for _ in range(60))
        return "  " + d.replace(" ", "\n", 2) if rng.random() < 0.2 else d

    settings = [
        {"dedup": "near", "decontaminate": True},
        {"dedup": "exact", "decontaminate": False},
        {"dedup": "near", "decontaminate": True},
    ]
    texts = [[doc() for _ in range(150)] for _ in settings]
    sources = []
    for k, (docs, st) in enumerate(zip(texts, settings)):
        (tmp_path / f"s{k}").mkdir()
        (tmp_path / f"s{k}" / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
        cfg = DataConfig(source=str(tmp_path / f"s{k}"), near_dup_threshold=0.7, near_dup_ngram=5, **st)
        sources.append((f"s{k}", cfg))
    monkeypatch.setattr(dedup, "PARTITION_BYTES", 4000)  # ~6 partitions a source
    monkeypatch.setattr(dedup_units, "BUCKET_DOCS", 40)  # 16 buckets
    store = Store(f"file://{tmp_path}/store")
    datasets = [download_dataset(cfg, store) for _, cfg in sources]
    got = dedup.dedup_sources(datasets, sources, store, EvalConfig())
    want = _reference(list(zip(texts, settings)), 0.7, items)
    for (_, info), reasons in zip(got, want):
        removed = np.load(store.local_path(join(info.key, dedup_units.REMOVED_DOCS)))["removed"].tolist()
        assert removed == [k for k, r in enumerate(reasons) if r not in ("kept", "cut")]
        assert (info.num_exact, info.num_near, info.num_contaminated, info.num_cut) == tuple(
            reasons.count(r) for r in ("exact", "near", "contaminated", "cut")
        )
    assert sum(info.num_near for _, info in got) > 10 and sum(info.num_exact for _, info in got) > 10
    assert sum(info.num_cut for _, info in got) > 0 and sum(info.num_contaminated for _, info in got) > 0
    assert not any(items[0].id in info.items for _, info in got)  # common: found in too many documents


def test_worker_processes_over_many_partitions_decide_as_one_process(corpus, tmp_path, monkeypatch):
    """The planted corpus cut into >= 4 partitions a source, its units run by 2 worker processes
    (a stage of any size, as at scale): the same removals, samples and kept datasets as the
    units run in this process; a rerun reads every decision."""
    here = _dedup(Store(f"file://{tmp_path}/a"), _data(corpus, dedup="near"))
    monkeypatch.setattr(dedup, "PARTITION_BYTES", 20_000)
    monkeypatch.setattr(dedup, "IN_PROCESS_BYTES", 0)
    store = Store(f"file://{tmp_path}/b")
    there = _dedup(store, _data(corpus, dedup="near", num_workers=2))
    assert len(store.walk_files("dedup/features")) >= 4 * 2 * 4  # >= 4 partitions a source, 4 files each
    assert [(d, i.as_dict() | {"key": 0}) for d, i in there] == [(d, i.as_dict() | {"key": 0}) for d, i in here]
    assert [dedup.removed_samples(store, i) for _, i in there] == [
        dedup.removed_samples(Store(f"file://{tmp_path}/a"), i) for _, i in here
    ]
    assert all(i.cache_hit for _, i in _dedup(store, _data(corpus, dedup="near", num_workers=2)))


def _pair(rng: random.Random, shared: int, words: int = 200) -> tuple[str, str]:
    """Two documents of `words` distinct words sharing their first `shared`: their 5-gram
    Jaccard similarity is exactly (shared - 4) / (2 * (words - 4) - (shared - 4))."""
    ws = rng.sample(POOL, 2 * words - shared)
    return " ".join(ws[:words]), " ".join(ws[:shared] + ws[words:])


def test_near_duplicates_are_found_at_the_rate_the_threshold_says(tmp_path):
    """400 pairs 0.05 above data.near_dup_threshold (0.849 at 0.8) and 400 pairs 0.15 below it
    (0.647): the first removed with probability >= 0.95, the second kept with >= 0.99, as
    minhash.removal_probability says (datasketch's 9 x 13 bands of 128 hashes removed ~0.65 of
    the first kind: the test fails on them)."""
    from stoker.data import minhash

    rng = random.Random(5)
    assert round((184 - 4) / (2 * 196 - 180), 3) == 0.849 and round((158 - 4) / (2 * 196 - 154), 3) == 0.647
    above = [_pair(rng, 184) for _ in range(400)]
    below = [_pair(rng, 158) for _ in range(400)]
    (tmp_path / "src").mkdir()
    for name, pairs in (("above", above), ("below", below)):
        docs = [a for a, _ in pairs] + [b for _, b in pairs]  # every original before its copy
        (tmp_path / "src" / f"{name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    store = Store(f"file://{tmp_path}/store")
    cfg = DataConfig(source=str(tmp_path / "src" / "above.jsonl"), dedup="near", decontaminate=False)
    [(_, found)] = dedup.dedup_sources([download_dataset(cfg, store)], [("main", cfg)], store, EvalConfig())
    cfg2 = cfg.model_copy(update={"source": str(tmp_path / "src" / "below.jsonl")})
    [(_, kept)] = dedup.dedup_sources([download_dataset(cfg2, store)], [("main", cfg2)], store, EvalConfig())
    assert found.num_near / 400 >= 0.95, found
    assert kept.num_near / 400 <= 0.01, kept
    assert minhash.removal_probability(0.849, 0.8) >= 0.95 and minhash.removal_probability(0.647, 0.8) <= 1e-3
