"""data.filters in the data stage: units over a source's stored parts, before dedup; counts per
filter, a sample with why, c4's edits kept; the filtered dataset is what dedup and the shards
read; cached per part (a grown source filters its new parts only); bad specs refused in one
line before any work; a source the filters empty is one DataError."""

from __future__ import annotations

import json
import random

import pytest

from stoker.config import DataConfig, EvalConfig, TokenizerConfig, load_config
from stoker.data import filtering
from stoker.data import prepare as data_prep
from stoker.failures import DataError
from stoker.storage.datasets import dataset_parts
from stoker.storage.store import Store
from tests.data.filter_docs import prose


def _web(n: int, seed: int) -> list[str]:
    """Prose, and junk a web crawl holds: too short, a bulleted menu, lines without punctuation."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            docs.append("Home | About | Contact")  # far fewer than 50 words
        elif kind == 1:
            docs.append("\n".join(f"- item {rng.randint(0, 999)} on sale" for _ in range(40)))
        else:
            docs.append(prose(rng))
    return docs


def _write(path, docs):
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))


def test_filters_run_as_units_before_dedup_and_their_removals_are_counted_cached_and_shown(tmp_path, monkeypatch):
    monkeypatch.setattr(data_prep, "PARTITION_BYTES", 4 << 20)
    src = tmp_path / "web"
    src.mkdir()
    _write(src / "a.jsonl", _web(80, 0))
    store = Store(f"file://{tmp_path}/store")
    data = DataConfig(source=str(src), filters=["gopher_quality", "c4"], val_fraction=0.1, shard_tokens=4096)
    computed = []
    real = filtering.filter_unit
    monkeypatch.setattr(
        filtering, "filter_unit", lambda store, **kw: computed.append(kw["part"]["key"]) or real(store, **kw)
    )
    shards = data_prep.prepare_all(data, TokenizerConfig(vocab_size=300), store, evaluation=EvalConfig())
    [f] = shards.filtered
    assert (f.num_docs_in, f.filters) == (80, ["gopher_quality", "c4"])
    assert f.removed["gopher_quality"] >= 20 and f.num_docs_out == 80 - sum(f.removed.values()) >= 30
    assert shards.dedup[0].num_docs_in == f.num_docs_out  # dedup read the filtered documents
    fingerprint = store.read_json(f"{f.key}/result.json")["fingerprint"]  # the filtered dataset
    kept = [
        json.loads(line)["text"]
        for p in dataset_parts(store, fingerprint)
        for line in store.read_bytes(p.key).splitlines()
    ]
    assert not any(d.startswith("Home |") for d in kept) and len(kept) == f.num_docs_out
    samples = filtering.removed_samples(store, f)
    assert {s["filter"] for s in samples} >= {"gopher_quality"} and all(s["reason"] and s["text"] for s in samples)
    rows = {r["stage"].split()[0]: r for r in shards.stage_rows()}
    assert rows["filter"]["docs_in"] == 80 and rows["filter"]["docs_out"] == rows["dedup"]["docs_in"]
    from stoker.observe.report import filter_line, filters_markdown

    assert filter_line(f).startswith("source 'main': filters gopher_quality, c4: 80 documents")
    assert "| main | gopher_quality, c4 | 80 |" in filters_markdown([f])
    # a rerun: every partition's result read; a grown source: only its new part is filtered
    n = len(computed)
    again = data_prep.prepare_all(data, TokenizerConfig(vocab_size=300), store, evaluation=EvalConfig())
    assert again.filtered[0].cache_hit and len(computed) == n
    _write(src / "b.jsonl", _web(40, 1))
    grown = data_prep.prepare_all(data, TokenizerConfig(vocab_size=300), store, evaluation=EvalConfig())
    assert grown.filtered[0].num_docs_in == 120 and len(computed) == n + 1


def test_a_bad_filter_is_one_line_before_any_work_and_a_source_emptied_is_a_data_error(tmp_path):
    from stoker import preflight
    from tests.conftest import tiny_dict

    cfg = load_config(tiny_dict(str(tmp_path / "store"), data={"filters": ["gopher", {"name": "c4", "min_words": 2}]}))
    found = preflight.filter_problems(cfg)
    assert len(found) == 2 and all(p.startswith("data.filters[") and "\n" not in p for p in found), found
    assert "'gopher' is not a filter" in found[0] and "gopher_quality" in found[0]
    src = tmp_path / "short.jsonl"
    _write(src, ["Home | About | Contact"] * 10)
    store = Store(f"file://{tmp_path}/store2")
    data = DataConfig(source=str(src), filters=["gopher_quality"])
    ds = data_prep.download_dataset(data, store)
    with pytest.raises(
        DataError, match=r"^data.filters: the filters gopher_quality removed every document of source 'main'"
    ):
        filtering.filter_sources([ds], [("main", data)], store)
