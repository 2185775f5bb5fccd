"""A data mixture through the whole flow: a local folder (the repository's docs) and an S3
source (moto) with a schedule of three weight changes. The data stage maps over the sources;
a byte flipped in the store's copy of one source's shards is found by the ranks, and the flow
rebuilds that set alone and launches again, once; the per-source validation losses reach the
events, the result, the report and `stoker runs`; a source added later tokenizes alone with the
run's own tokenizer while the others show Cached."""

import contextlib
import io
import json
import os

import pytest
import s3fs

from stoker.config import load_config
from stoker.storage.shards import validate_shard_set
from stoker.storage.store import Store
from tests.conftest import ROOT, task_states, tiny_dict

pytestmark = pytest.mark.e2e


def _web_corpus(s3_root) -> tuple[str, dict]:
    """Stoker's own sources as JSON lines in the bucket: the 'web' source."""
    root, options = s3_root
    fs = s3fs.S3FileSystem(**options)
    bucket = root.split("://", 1)[1].split("/", 1)[0]
    docs, size = [], 0
    for folder, _, files in sorted(os.walk(os.path.join(ROOT, "stoker"))):
        for name in sorted(files):
            if name.endswith(".py") and size < 200_000:
                text = open(os.path.join(folder, name)).read()
                docs.append(json.dumps({"text": text}))
                size += len(text)
    half = len(docs) // 2
    for i, part in enumerate((docs[:half], docs[half:])):
        fs.pipe(f"{bucket}/web/part-{i}.jsonl", ("\n".join(part) + "\n").encode())
    return f"s3://{bucket}/web/*.jsonl", {"endpoint_url": options["endpoint_url"]}


def test_a_mixture_flows_through_heals_a_damaged_set_and_grows_a_source(prefect_server, s3_root, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from stoker.cli import main
    from stoker.flows.pipeline import prepare_data, train_pipeline

    web, web_options = _web_corpus(s3_root)
    root = "file://" + str(tmp_path / "store")
    sources = [
        {"name": "docs", "source": os.path.join(ROOT, "docs"), "weight": 0.7},
        {"name": "web", "source": web, "weight": 0.3, "storage_options": web_options},
    ]
    schedule = [  # three changes of the weights
        {"at_step": 2, "weights": {"docs": 0.5, "web": 0.5}},
        {"at_step": 4, "weights": {"web": 1.5}},
        {"at_step": 6, "weights": {"docs": 0.9, "web": 0.1}},
    ]
    cfg = load_config(
        tiny_dict(root, run_name="mixed", data={"val_fraction": 0.1, "sources": sources, "schedule": schedule})
    )
    first = prepare_data(cfg.data, cfg.tokenizer, cfg.storage, run="mixed", return_state=True)
    per_source = [
        "download_dataset[docs]",
        "download_dataset[web]",
        "tokenize_and_shard[docs]",
        "tokenize_and_shard[web]",
    ]
    expect = [*per_source, "train_tokenizer", "filter_documents", "dedup_and_decontaminate"]
    assert task_states(first, expect) == dict.fromkeys(expect, "Completed")
    # each data stage's progress as it went: a progress artifact per stage, at 100% when done
    with get_client(sync_client=True) as client:
        progress = {
            a.key: a
            for a in client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(like_="-")))
            if a.type == "progress"
        }
    stages = ["mixed-dedup-features", "mixed-dedup-buckets", "mixed-dedup-decision", "mixed-dedup-publish"]
    assert set(stages) <= set(progress) and any(k.startswith("docs-") and k.endswith("-tokenize") for k in progress)
    assert all(progress[k].data == 100.0 and "units" in progress[k].description for k in stages), progress
    # and, per source and stage, what went in and out: a table artifact (a log line each too)
    with get_client(sync_client=True) as client:
        [table] = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["mixed-data-stages"]))
        )
    rows = json.loads(table.data)
    assert [(r["source"], r["stage"].split()[0]) for r in rows] == [
        (s, stage) for s in ("docs", "web") for stage in ("download", "dedup", "tokenize")
    ]
    by = {(r["source"], r["stage"].split()[0]): r for r in rows}
    for s in ("docs", "web"):  # each stage takes what the one before gave
        assert by[(s, "dedup")]["docs_in"] == by[(s, "download")]["docs_out"] > 0 and by[(s, "download")]["parts"] >= 1
        assert by[(s, "tokenize")]["docs_in"] == by[(s, "dedup")]["docs_out"]
    shards = {s.name: s for s in first.result().sets}
    for s in ("docs", "web"):
        assert by[(s, "tokenize")]["tokens_out"] == shards[s].num_train_tokens + shards[s].num_val_tokens

    # a byte flipped in the store's copy of the web source's shards: only the ranks read it
    store = Store(root)
    web_key, docs_key = shards["web"].key, shards["docs"].key
    [part] = [n for n in store.walk_files(web_key) if n.startswith("train") and n.endswith(".bin")][:1]
    data = bytearray(store.read_bytes(f"{web_key}/{part}"))
    data[10] ^= 1
    store.write_bytes(f"{web_key}/{part}", bytes(data))
    docs_files = {n: os.stat(store.local_path(f"{docs_key}/{n}")).st_ino for n in store.walk_files(docs_key)}

    result = train_pipeline(cfg)
    assert result.final_step == 8 and result.last_val_loss is not None
    assert validate_shard_set(store, shards["web"].cache_key, deep=True)  # rebuilt, the same key
    assert {n: os.stat(store.local_path(f"{docs_key}/{n}")).st_ino for n in store.walk_files(docs_key)} == docs_files
    assert [a["outcome"] for a in result.attempts][-1] == "completed"

    # per source: the in-loop evaluations, the final evaluation, the report and `stoker runs`
    records = [json.loads(x) for x in store.read_bytes("runs/mixed/metrics.jsonl").splitlines()]
    evals = [r for r in records if r["event"] == "eval"]
    assert evals and all(set(r["sources"]) == {"docs", "web"} for r in evals)
    mix = {r["step"]: r["sources"] for r in records if r["event"] == "train"}
    assert mix[8]["docs"]["tokens"] + mix[8]["web"]["tokens"] == 8 * 8 * 32
    rows = {r["source"]: r for r in result.sources}
    assert set(rows) == {"docs", "web"}
    assert all(r["final_val_loss"] is not None and r["val_loss"] is not None for r in rows.values())
    assert rows["web"]["tokens_trained"] == mix[8]["web"]["tokens"]
    assert store.exists("runs/mixed/data-mix.png")
    with get_client(sync_client=True) as client:
        [report] = [
            a
            for a in client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(like_="mixed-report")))
            if a.type == "markdown"
        ][-1:]
    assert "## Data mixture" in report.data and "| web |" in report.data and "K=" in report.data
    assert "## Data: per source and stage" in report.data and "| web | tokenize |" in report.data
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["runs", "--root", root]) == 0
    [row] = [line for line in out.getvalue().splitlines() if line.startswith("mixed")]
    assert "docs " in row and "web " in row and " val " in row
    assert "docs: " in row and " parts > " in row and " tokens" in row  # the data stage per source

    # a source added to the finished data stage: it alone is downloaded and tokenized, with the
    # run's tokenizer (the other sources' shard sets, hence keys, stay)
    grown = cfg.data.model_copy(
        update={
            "sources": [
                *cfg.data.sources,
                cfg.data.sources[0].model_copy(
                    update={"name": "stdlib", "source": "builtin:stdlib", "max_bytes": 100_000}
                ),
            ]
        }
    )
    again = prepare_data(grown, cfg.tokenizer, cfg.storage, run="mixed", return_state=True)
    states = task_states(again, [*per_source, "download_dataset[stdlib]", "tokenize_and_shard[stdlib]"])
    assert {k: states[k] for k in per_source} == dict.fromkeys(per_source, "Cached")
    assert states["download_dataset[stdlib]"] == states["tokenize_and_shard[stdlib]"] == "Completed"
    assert {s.name: s.cache_key for s in again.result().sets if s.name != "stdlib"} == {
        n: s.cache_key for n, s in shards.items()
    }
