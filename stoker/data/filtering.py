"""data.filters: the published quality filters (stoker.data.filters) run over each source's stored
parts as units of work (stoker.data.units: worker processes or Ray tasks), before deduplication.

Per source with filters, one ``filter_unit`` per partition (a byte range of a stored part, at
data.partition_bytes): its documents streamed once through the filters, the kept ones (c4's
edited text where it drops lines) written as one part of their own (stored by content, as any
part), and a small result last: documents and bytes in and out, documents removed per filter,
documents c4 edited, and the first removed documents of each filter with why (a sample for a
person to read). Cached per partition by the part's content and the filters' spec: a grown
source filters only its new parts, a rerun nothing. The filtered documents are then a dataset
of their own, whose fingerprint is the hash of the source's and of the spec (it is derived, so
it is named by what it is derived from), published with its parts in order; dedup and the
tokenizer read it. A source without filters is read as it is.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections import Counter

from stoker.config import DataConfig, RayConfig
from stoker.contracts.results import DatasetInfo, FilterInfo
from stoker.data.sharding import corpus_text, part_ranges, store_lines
from stoker.data.units import ProgressFn, Unit, engine_session, run_units
from stoker.storage.datasets import Part, PartWriter, committed_dataset, dataset_key, dataset_parts, publish_dataset
from stoker.storage.store import Store, build_lock, join

FILTER_VERSION = 1  # of the units' layout and rule: a change filters every part anew
SAMPLE_DOCS = 5  # removed documents kept per filter and partition (the report shows the first 20)
SAMPLE_SHOWN = 20
EXCERPT_CHARS = 600
PARTITION_BYTES = None  # data.partition_bytes unless set (tests cut smaller partitions)
IN_PROCESS_BYTES = 32 << 20  # a smaller stage runs its units in this process
RESULT = "result.json"
REMOVED = "removed.jsonl"


def _digest(what) -> str:
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:24]


def filter_unit(store: Store, *, spec: list, part: dict, start: int, end: int, out: str) -> dict:
    """One partition through the filters (see the module doc); cached at `out`."""
    try:
        return store.read_json(out) | {"docs": 0, "cached": True}
    except (FileNotFoundError, ValueError):
        pass
    from stoker.data.filters import make_filters

    filters = make_filters(spec)

    removed: Counter = Counter()
    samples: list[dict] = []
    docs_in = bytes_in = docs_out = bytes_out = edited = 0
    with tempfile.TemporaryDirectory(prefix="stoker-filter-") as tmp:
        writer = PartWriter(store, tmp, part["size"] + 1)  # one part: the range's kept documents
        for offset, line in store_lines(store, part["key"], part["size"], start, end):
            text = corpus_text(line, offset)
            docs_in += 1
            bytes_in += len(text.encode("utf-8"))
            verdict = filters.check(text)
            if verdict.text is None or not verdict.text.strip():
                by = verdict.removed_by or filters.names[-1]
                removed[by] += 1
                if removed[by] <= SAMPLE_DOCS:
                    samples.append(
                        {"filter": by, "reason": verdict.reason or "no text left", "text": text[:EXCERPT_CHARS]}
                    )
                continue
            if verdict.text != text:
                edited += 1
            writer.add(json.dumps({"text": verdict.text}, ensure_ascii=False).encode("utf-8") + b"\n")
            docs_out += 1
            bytes_out += len(verdict.text.encode("utf-8"))
        parts, _ = writer.close()
    result = {
        "part": parts[0].entry() if parts else None,
        "docs_in": docs_in,
        "bytes_in": bytes_in,
        "docs_out": docs_out,
        "bytes_out": bytes_out,
        "edited": edited,
        "removed": dict(removed),
        "samples": samples,
    }
    store.write_json(out, result)  # last: the partition is filtered
    return result | {"docs": docs_in, "cached": False}


def filter_sources(
    datasets: list[DatasetInfo],
    sources: list[tuple[str, DataConfig]],
    store: Store,
    ray: RayConfig | None = None,
    on_progress: ProgressFn | None = None,
) -> list[tuple[DatasetInfo, FilterInfo | None]]:
    """Each source's filtered dataset (its own where it has no filters) and what the filters
    removed, in the order of `sources` (see the module doc)."""
    from stoker.data.filters import make_filters

    out: list = [(ds, None) for ds in datasets]
    plans = []
    for i, ((name, cfg), ds) in enumerate(zip(sources, datasets)):
        if not cfg.filters:
            continue
        filters = make_filters(cfg.filters)  # a bad spec: one ConfigError (preflight said so first)
        what = [FILTER_VERSION, filters.spec, filters.implementation]
        key = join("filters", _digest([what, ds.fingerprint]))
        fingerprint = _digest(["filtered", ds.fingerprint, what])
        parts = dataset_parts(store, ds.fingerprint)
        partition_bytes = PARTITION_BYTES or cfg.partition_bytes
        ranges = part_ranges([p.size for p in parts], partition_bytes)
        units = [
            Unit(
                "stoker.data.filtering:filter_unit",
                dict(
                    spec=filters.spec,
                    part=parts[p].entry(),
                    start=a,
                    end=b,
                    out=join("filters", "parts", _digest(what), parts[p].sha256, f"{a}-{b}.json"),
                ),
                f"filters {name!r} part {k}",
            )
            for k, (p, a, b) in enumerate(ranges)
        ]
        plans.append((i, name, cfg, ds, filters, key, fingerprint, units))
    if not plans:
        return out
    first = plans[0][2]
    total = sum(ds.num_bytes for _, _, _, ds, *_ in plans)
    with engine_session(first.engine, ray):
        for i, name, cfg, ds, filters, key, fingerprint, units in plans:
            done = _committed(store, key)
            if done is None:
                results = run_units(
                    "filters",
                    units,
                    store,
                    engine=cfg.engine,
                    workers=cfg.resolved_workers(),
                    ray=ray,
                    in_process=total < IN_PROCESS_BYTES,
                    on_progress=on_progress,
                )
                done = _publish(store, key, fingerprint, name, ds, filters, results)
                cached = False
            else:
                cached = True
            out[i] = (
                DatasetInfo(
                    done["fingerprint"],
                    dataset_key(done["fingerprint"]),
                    done["docs_out"],
                    done["bytes_out"],
                    ds.cache_hit,
                    ds.num_skipped_files,
                    ds.capped_at,
                    done["num_parts"],
                ),
                FilterInfo(
                    name,
                    key,
                    filters.names,
                    done["docs_in"],
                    done["bytes_in"],
                    done["docs_out"],
                    done["bytes_out"],
                    done["removed"],
                    done["edited"],
                    cached,
                ),
            )
    return out


def _committed(store: Store, key: str) -> dict | None:
    try:
        done = store.read_json(join(key, RESULT))
    except (FileNotFoundError, ValueError):
        return None
    return done if committed_dataset(store, done["fingerprint"]) is not None else None


def _publish(
    store: Store, key: str, fingerprint: str, name: str, ds: DatasetInfo, filters, results: list[dict]
) -> dict:
    parts = [
        Part(r["part"]["key"], r["part"]["size"], r["part"]["sha256"], r["part"]["num_docs"])
        for r in results
        if r["part"]
    ]
    total = {k: sum(r[k] for r in results) for k in ("docs_in", "bytes_in", "docs_out", "bytes_out", "edited")}
    removed: Counter = Counter()
    for r in results:
        removed.update(r["removed"])
    if not parts:
        from stoker.failures import DataError

        raise DataError(
            f"data.filters: the filters {', '.join(filters.names)} removed every document of source {name!r} "
            f"({total['docs_in']} in); remove or loosen them for this source (data.sources[].filters)."
        )
    with build_lock(store, dataset_key(fingerprint)):
        if committed_dataset(store, fingerprint) is None:
            info = {
                "source": f"data.filters {', '.join(filters.names)} of {ds.fingerprint}",
                "fingerprint": fingerprint,
                "derived_from": ds.fingerprint,
                "filters": filters.spec,
                "num_docs": total["docs_out"],
                "num_bytes": total["bytes_out"],
            }
            publish_dataset(store, fingerprint, parts, info)
    samples = [s for r in results for s in r["samples"]]
    shown: Counter = Counter()
    kept = []
    for s in samples:
        shown[s["filter"]] += 1
        if shown[s["filter"]] <= SAMPLE_SHOWN:
            kept.append({"source": name, **s})
    store.write_bytes(join(key, REMOVED), "".join(json.dumps(s, ensure_ascii=False) + "\n" for s in kept).encode())
    done = {
        **total,
        "removed": dict(removed),
        "fingerprint": fingerprint,
        "num_parts": len(parts),
        "filters": filters.names,
    }
    store.write_json(join(key, RESULT), done)  # last: the source's filtering is committed
    return done


def removed_samples(store: Store, info: FilterInfo) -> list[dict]:
    """The sample of documents the filters removed from one source, with why."""
    from stoker.data.dedup import read_samples

    return read_samples(store, join(info.key, REMOVED))
