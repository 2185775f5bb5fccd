"""data.dedup and data.decontaminate: which documents of each source train, decided once, in
units of work over partitions and buckets (stoker.data.dedup_units, run by stoker.data.units
locally or as Ray tasks), so that no process holds the whole corpus's features and this one
holds nothing per document.

Per source, the decision (``dedup/{key}/``) follows the sources in their listed order: a
document is removed when it holds an evaluation item, else when an earlier kept document (of an
earlier source, or earlier in this source's files) has its digest ('exact' and 'near'), or a
signature whose estimated Jaccard similarity reaches data.near_dup_threshold and shares a band
with it ('near': bands chosen for recall at that threshold, minhash.bands). So which copy
survives is a pure function of the content and the source order. The kept documents are
published as a dataset of their own (content fingerprint, as any download), which the
tokenizer and the shards then use; nothing removed: the source's own dataset. The key holds
the fingerprints and settings of this source and every one before it: a rerun is a hit, and a
source added at the end costs its own features and the buckets, never the earlier sources'
features, and a grown source only its new parts' (cached per byte range of a stored part, by the
part's content: ``dedup/features/{settings}/{part sha256}/{start}-{end}/``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections import Counter
from dataclasses import dataclass

from stoker.config import DataConfig, EvalConfig, RayConfig
from stoker.contracts.results import DatasetInfo, DedupInfo
from stoker.data import dedup_units
from stoker.data.dedup_units import REMOVED_FILE, RESULT_FILE
from stoker.data.evalitems import EvalItem, eval_items, items_fingerprint
from stoker.data.minhash import MINHASH_SCHEME, MINHASH_SEED, NUM_PERM, bands
from stoker.data.sharding import part_ranges
from stoker.data.units import ProgressFn, Unit, engine_session, run_units
from stoker.storage.datasets import Part, committed_dataset, dataset_key, dataset_parts
from stoker.storage.store import Store, join

log = logging.getLogger("stoker.data")
DEDUP_VERSION = 4  # of the features, their layout and the decision rule: a change makes every result anew
PARTITION_BYTES = None  # data.partition_bytes unless set (tests cut smaller partitions)
IN_PROCESS_BYTES = 32 << 20  # a smaller stage runs its units in this process (a worker costs more)
UNITS = "stoker.data.dedup_units"


# ---- settings --------------------------------------------------------------------------
@dataclass(frozen=True)
class FeatureSpec:
    """What one pass over a corpus computes: signatures when `near_ngram`, matches when `index`."""

    near_ngram: int | None
    decontaminate_ngram: int | None
    items_fingerprint: str | None

    def key(self) -> str:
        import datasketch

        what = [
            DEDUP_VERSION,
            [self.near_ngram, NUM_PERM, MINHASH_SEED, MINHASH_SCHEME, datasketch.__version__]
            if self.near_ngram
            else None,
            [self.decontaminate_ngram, self.items_fingerprint] if self.decontaminate_ngram else None,
        ]
        return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:24]


def settings_of(cfg: DataConfig) -> dict:
    """The data options that shape one source's decision."""
    return {
        "dedup": cfg.dedup,
        "near_dup_threshold": cfg.near_dup_threshold if cfg.dedup == "near" else None,
        "near_dup_ngram": cfg.near_dup_ngram if cfg.dedup == "near" else None,
        "decontaminate": cfg.decontaminate,
        "decontaminate_ngram": cfg.decontaminate_ngram if cfg.decontaminate else None,
        "decontaminate_max_docs": cfg.decontaminate_max_docs if cfg.decontaminate else None,
    }


def _info(name: str, key: str, dataset: DatasetInfo, result: dict, cache_hit: bool) -> tuple[DatasetInfo, DedupInfo]:
    fp = result["output_fingerprint"]
    out = DatasetInfo(
        fp,
        dataset_key(fp),
        result["num_docs_out"],
        result["num_bytes_out"],
        dataset.cache_hit,
        dataset.num_skipped_files,
        dataset.capped_at,
        dataset.num_parts,
    )
    info = DedupInfo(
        name=name,
        key=key,
        dedup=result["settings"]["dedup"],
        decontaminate=result["settings"]["decontaminate"],
        num_docs_in=result["num_docs_in"],
        num_bytes_in=result["num_bytes_in"],
        num_exact=result["num_exact"],
        num_near=result["num_near"],
        num_contaminated=result["num_contaminated"],
        num_docs_out=result["num_docs_out"],
        num_bytes_out=result["num_bytes_out"],
        items=result["items"],
        cache_hit=cache_hit,
        num_cut=result.get("num_cut", 0),
        items_checked=result.get("items_checked", {}),
    )
    return out, info


def _feature_spec(cfg: DataConfig, any_near: bool, items_print: str | None) -> FeatureSpec:
    return FeatureSpec(
        cfg.near_dup_ngram if any_near else None,
        cfg.decontaminate_ngram if cfg.decontaminate else None,
        items_print if cfg.decontaminate else None,
    )


def checked_items(sources: list[DataConfig], evaluation: EvalConfig | None) -> list[EvalItem] | None:
    """The evaluation items to check when any source decontaminates (None: none does). A
    source that asked for it (data.decontaminate true) with no item to check is one DataError,
    as the config's own rule says before any work; one that left it empty decontaminates where
    the run scores an evaluation set."""
    if not any(cfg.decontaminate is not False for cfg in sources):
        return None
    items = eval_items(evaluation or EvalConfig())
    if not items and any(cfg.decontaminate for cfg in sources):
        from stoker.failures import DataError

        raise DataError(
            "data.decontaminate: the run scores no evaluation set to check the training data against "
            "(eval.sets has no 'multiple_choice', eval.harness_tasks is empty); add one, or set data.decontaminate false."
        )
    return items or None


def resolved(cfg: DataConfig, items: list[EvalItem] | None) -> DataConfig:
    """A source's settings as decided: decontaminate left empty is true where there are items."""
    return cfg.model_copy(update={"decontaminate": cfg.decontaminate is not False and bool(items)})


def _items_of(cfg: DataConfig, items: list[EvalItem] | None) -> list[EvalItem] | None:
    return items if cfg.decontaminate else None


# ---- the decision of each source, by its prefix of the mixture ------------------------------------
def _result_key(prefix: list[tuple[str, dict]], items_print: str | None) -> str:
    what = [
        DEDUP_VERSION,
        [[fp, s] for fp, s in prefix],
        items_print if any(s["decontaminate"] for _, s in prefix) else None,
    ]
    return join("dedup", hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:24])


def _committed_result(store: Store, key: str) -> dict | None:
    """result.json of a decision whose output dataset is in the store."""
    try:
        result = store.read_json(join(key, RESULT_FILE))
    except (FileNotFoundError, ValueError):
        return None
    return result if committed_dataset(store, result["output_fingerprint"]) is not None else None


def _digest(what) -> str:
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:24]


@dataclass
class _Source:
    """What the units need of one source: its partitions (byte ranges of its stored parts)
    and where their features go."""

    name: str
    cfg: DataConfig
    dataset: DatasetInfo
    features: str  # dedup/features/{settings}
    parts: list[Part]
    ranges: list[tuple[int, int, int]]  # (part, start, end)

    @property
    def size(self) -> int:
        return sum(p.size for p in self.parts)

    def folder(self, p: int) -> str:
        part, start, end = self.ranges[p]
        return join(self.features, self.parts[part].sha256, f"{start}-{end}")

    def where(self, p: int) -> dict:
        """The partition's bytes: a stored part's key and size and a byte range of it."""
        part, start, end = self.ranges[p]
        return dict(corpus=self.parts[part].key, size=self.parts[part].size, start=start, end=end)


def dedup_sources(
    datasets: list[DatasetInfo],
    sources: list[tuple[str, DataConfig]],
    store: Store,
    evaluation: EvalConfig | None = None,
    ray: RayConfig | None = None,
    on_progress: ProgressFn | None = None,
) -> list[tuple[DatasetInfo, DedupInfo]]:
    """Each source's kept documents (a dataset to tokenize) and what was removed from it and
    why, in the order of `sources` (see the module docstring). Sources whose decision is in the
    store cost one read each; otherwise four stages of units, each cached by content: the
    features of every partition (computed only where missing), the buckets, the decision, the
    kept documents of each source decided. `on_progress` sees every finished unit."""
    items = checked_items([cfg for _, cfg in sources], evaluation)
    sources = [(name, resolved(cfg, items)) for name, cfg in sources]
    cfgs = [cfg for _, cfg in sources]
    items_print = items_fingerprint(items) if items is not None else None
    prefix = [(d.fingerprint, settings_of(cfg)) for d, cfg in zip(datasets, cfgs)]
    keys = [_result_key(prefix[: i + 1], items_print) for i in range(len(sources))]
    done = [_committed_result(store, key) for key in keys]
    todo = [d is None for d in done]
    if any(todo):
        plan = _plan(store, datasets, sources, items_print)
        with engine_session(plan[0].cfg.engine, ray):  # data.engine 'ray': one connection for the stages
            _decide(store, plan, keys, todo, items, items_print, ray, on_progress)
        done = [d if d is not None else _committed_result(store, key) for d, key in zip(done, keys)]
        if any(d is None for d in done):
            raise OSError("data.dedup: a source's decision was not in the store after it was made; run again")
    return [_info(name, keys[i], datasets[i], done[i], cache_hit=not todo[i]) for i, (name, _) in enumerate(sources)]


def _plan(
    store: Store, datasets: list[DatasetInfo], sources: list[tuple[str, DataConfig]], items_print
) -> list[_Source]:
    any_near = any(cfg.dedup == "near" for _, cfg in sources)
    plan = []
    for (name, cfg), ds in zip(sources, datasets):
        spec = _feature_spec(cfg, any_near, items_print)
        parts = dataset_parts(store, ds.fingerprint)
        folder = join("dedup", "features", spec.key())
        partition_bytes = PARTITION_BYTES or cfg.partition_bytes  # the same cut on every engine
        plan.append(_Source(name, cfg, ds, folder, parts, part_ranges([p.size for p in parts], partition_bytes)))
    return plan


def _decide(store, plan: list[_Source], keys, todo, items, items_print, ray, on_progress) -> None:
    """The four stages of units (stoker.data.dedup_units) for the sources not yet decided."""
    first = plan[0].cfg
    any_near = any(s.cfg.dedup == "near" for s in plan)
    threshold = first.near_dup_threshold
    band = list(bands(threshold)) if any_near else None
    total = sum(s.size for s in plan)
    run = dict(
        engine=first.engine,
        workers=first.resolved_workers(),
        ray=ray,
        in_process=total < IN_PROCESS_BYTES,
        on_progress=on_progress,
    )
    items_key = dedup_units.put_items(store, items, items_print) if items else None
    units = []
    for s in plan:
        spec = _feature_spec(s.cfg, any_near, items_print)
        for p in range(len(s.ranges)):
            folder = s.folder(p)
            if store.exists(join(folder, dedup_units.META)) and (
                not band or store.exists(join(folder, f"bands-{band[0]}x{band[1]}.done"))
            ):
                continue
            args = dict(folder=folder, **s.where(p), bands=band)
            args.update(
                near_ngram=spec.near_ngram,
                items=items_key if spec.decontaminate_ngram else None,
                n=spec.decontaminate_ngram or 0,
            )
            units.append(Unit(f"{UNITS}:features_unit", args, f"computes the dedup features of {s.name!r} part {p}"))
    run_units("dedup features", units, store, **run)

    parts = [[i, p, s.folder(p)] for i, s in enumerate(plan) for p in range(len(s.ranges))]
    num_docs = sum(s.dataset.num_docs for s in plan)
    nb = min(dedup_units.SLOTS, 1 << max(0, math.ceil(num_docs / dedup_units.BUCKET_DOCS) - 1).bit_length())
    scope = _digest([DEDUP_VERSION, [[s.folder(p) for p in range(len(s.ranges))] for s in plan], band, threshold, nb])
    buckets = join("dedup", "buckets", scope)
    units = [
        Unit(
            f"{UNITS}:bucket_unit",
            dict(out=buckets, parts=parts, bucket=b, num_buckets=nb, bands=band, threshold=threshold),
            f"finds the duplicates of bucket {b} of {nb}",
        )
        for b in range(nb)
        if not store.exists(join(buckets, f"b-{b:05d}.npz"))
    ]
    run_units("dedup buckets", units, store, **run)

    metas = [[store.read_json(join(s.folder(p), dedup_units.META)) for p in range(len(s.ranges))] for s in plan]
    sources = [
        {
            "name": s.name,
            "settings": {"dedup": s.cfg.dedup, "decontaminate": bool(s.cfg.decontaminate)},
            "parts": [[s.folder(p), s.where(p), m["num_docs"]] for p, m in enumerate(ms)],
            "num_docs": s.dataset.num_docs,
        }
        for s, ms in zip(plan, metas)
    ]
    max_docs = first.decontaminate_max_docs
    decision = join("dedup", "decisions", _digest([scope, [src["settings"] for src in sources], items_print, max_docs]))
    args = dict(
        out=decision,
        buckets=buckets,
        num_buckets=nb,
        sources=sources,
        threshold=threshold,
        items=items_key,
        max_docs=max_docs,
    )
    run_units("dedup decision", [Unit(f"{UNITS}:decide_unit", args, "decides which documents train")], store, **run)

    units = []
    for i, s in enumerate(plan):
        if todo[i]:
            ds = s.dataset
            args = dict(
                decision=decision,
                index=i,
                result=keys[i],
                dataset={
                    "fingerprint": ds.fingerprint,
                    "key": ds.key,
                    "num_docs": ds.num_docs,
                    "num_bytes": ds.num_bytes,
                    "parts": [p.entry() for p in s.parts],
                },
                partition_bytes=PARTITION_BYTES or s.cfg.partition_bytes,
                settings=settings_of(s.cfg),
                num_bytes_in=sum(m["num_bytes"] for m in metas[i]),
                items_checked=dict(Counter(it.id.split(":")[0] for it in items)) if s.cfg.decontaminate else {},
            )
            units.append(Unit(f"{UNITS}:publish_unit", args, f"publishes the kept documents of {s.name!r}"))
    run_units("dedup publish", units, store, **run)


def read_samples(store: Store, key: str) -> list[dict]:
    """The records of a JSON-lines sample in the store ([] when there is none)."""
    try:
        raw = store.read_bytes(key)
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in raw.decode("utf-8").splitlines() if line]


def removed_samples(store: Store, info: DedupInfo) -> list[dict]:
    """The sample of removed documents (with what they matched) of one source's decision."""
    return read_samples(store, join(info.key, REMOVED_FILE))
