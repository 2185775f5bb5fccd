"""data.dedup and data.decontaminate with real parts: a corpus written here with planted exact
copies (whitespace changed), near copies (two words changed) and documents holding items of
the vendored evaluation set, in two sources; the counts removed are the ones planted, and the
shards of the kept documents are the same bytes on the local engine and on Ray."""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import sysconfig

import pytest

from stoker.config import DataConfig, EvalConfig, RayConfig, TokenizerConfig, load_config
from stoker.data import dedup
from stoker.data.evalitems import VENDORED_SET, _vendored_items
from stoker.data.prepare import download_dataset, prepare_all
from stoker.failures import ConfigError
from stoker.storage.store import Store, join

needs_ray = pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray is not installed")
VOCAB = [f"w{i}" for i in range(3000)]
PLANTED = {"exact_a": 3, "near_a": 2, "eval_a": 2, "cross_b": 2}


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
    assert (domain.num_exact, domain.num_near, domain.num_contaminated) == (3, 2, 2)
    assert domain.items == {"stoker_mc:0": 1, "stoker_mc:1": 1}
    assert (replay.num_exact, replay.num_near, replay.num_contaminated) == (2, 0, 0)  # trains once, in domain
    assert (domain.num_docs_out, replay.num_docs_out) == (40, 20)
    samples = dedup.removed_samples(store, domain)
    assert {s["reason"] for s in samples} == {"exact", "near", "contaminated"}
    near = [s for s in samples if s["reason"] == "near"]
    assert all(s["kept_source"] == "domain" and 0.8 <= s["similarity"] < 1 for s in near)
    # what a person reads of it: the log line, the report's section, `stoker runs`' column
    from stoker.observe.inspect import removed_summary
    from stoker.observe.report import dedup_line, dedup_markdown
    from stoker.storage.layout import run_file_key

    assert (
        dedup_line(domain).startswith("source 'domain': 47 documents")
        and "removed 3 exact and 2 near duplicates (data.dedup near), 2 holding evaluation items (stoker_mc:0, stoker_mc:1)"
        in dedup_line(domain)
    )
    section = dedup_markdown([domain, replay], "file:///x/dedup-removed.jsonl")
    assert (
        "| domain | near | 47 |" in section
        and "| 3 | 2 | 2 | 2 | 40 |" in section
        and "| 2 | 0 | 0 | 0 | 20 |" in section
    )
    assert "domain: stoker_mc:0, stoker_mc:1" in section and "file:///x/dedup-removed.jsonl" in section
    store.write_json(run_file_key("r", "shards.json"), {"dedup": [domain.as_dict(), replay.as_dict()]})
    assert removed_summary(store, "r") == "exact 5, near 2, eval 2 (2 items)"


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
    computed = []
    real = dedup._compute_features
    monkeypatch.setattr(
        dedup, "_compute_features", lambda store, ds, *a: computed.append(ds.fingerprint) or real(store, ds, *a)
    )
    both = _dedup(store, data)
    assert both[0][1].cache_hit and both[0][0].fingerprint == one[0][0].fingerprint  # read, not redone
    assert not both[1][1].cache_hit and both[1][1].num_exact == 2  # the copies of domain documents
    assert len(computed) == 1  # only the added source's features
    again = _dedup(store, data)
    assert all(info.cache_hit for _, info in again) and len(computed) == 1


def test_decontamination_finds_the_items_of_the_vendored_set_in_their_source_files(tmp_path):
    """What a run with data.max_bytes 0 reads of the standard library: the files the set was
    cut from. Every item is found but one, whose passage the document split cuts in two at a
    blank line (no 13 words of it in one document)."""
    meta = json.loads(open(VENDORED_SET).readline())["meta"]
    src = tmp_path / "src"
    src.mkdir()
    for name in meta["files"]:
        shutil.copy(os.path.join(sysconfig.get_paths()["stdlib"], name), src / name)
    store = Store(f"file://{tmp_path}/store")
    cfg = DataConfig(source=str(src), max_bytes=0)
    info = dedup.dedup_sources([download_dataset(cfg, store)], [("main", cfg)], store, EvalConfig())[0][1]
    assert set(f"stoker_mc:{i}" for i in range(500)) - set(info.items) == {"stoker_mc:200"}
    assert info.num_contaminated > 0 and info.num_docs_out == info.num_docs_in - info.num_contaminated


@pytest.mark.parametrize(
    "data, field",
    [
        ({"near_dup_threshold": 0}, "data.near_dup_threshold"),
        ({"near_dup_threshold": 1.01}, "data.near_dup_threshold"),
        ({"decontaminate_ngram": 4}, "data.decontaminate_ngram"),
        ({"near_dup_ngram": 3}, "data.near_dup_ngram"),
        ({"dedup": "fuzzy"}, "data.dedup"),
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
def test_two_ray_nodes_remove_the_same_documents_and_give_the_same_shard_bytes(ray_cluster, corpus, tmp_path):
    local, local_files = _shards(Store(f"file://{tmp_path}/a"), _data(corpus, dedup="near"))
    root, options = ray_cluster.bucket()
    ray = RayConfig(address=ray_cluster.cluster.client_address)
    data = _data(corpus, dedup="near", engine="ray")
    store = Store(root, options)
    shards = prepare_all(data, TokenizerConfig(vocab_size=300), store, ray=ray, evaluation=EvalConfig())
    files = {}
    for s in shards.sets:
        manifest = store.read_json(join(s.key, "manifest.json"))
        files.update({f"{s.name}/{n}": store.read_bytes(join(s.key, n)) for n in manifest["files"]})
    assert [(d.num_exact, d.num_near, d.num_contaminated) for d in shards.dedup] == [(3, 2, 2), (2, 0, 0)]
    assert files == local_files
