"""data.filters: documents per CPU-second of each published filter as stoker runs it (datatrove's
filter given stoker's word splitter, through Filters.check) against datatrove's filter as it
ships (its English splitter: spaCy, when spaCy is installed), on generated English and junk
documents (tests/data/filter_docs.py); and where spaCy is there, how often the two decide a
document differently: on those documents, and on the real English of this machine (the Python
reference's text, pydoc_data, and every licence and copyright file under /usr/share, with their
paragraphs as documents of their own).

    python -m benchmarks.bench_filters               # 3000 documents
    python -m benchmarks.bench_filters --docs 10000
"""

from __future__ import annotations

import argparse
import glob
import importlib
import json
import time

from stoker.data import filters as F
from tests.data.filter_docs import mixed_documents


def _datatrove(name: str, language):
    module, cls = F._CLASSES[name].rsplit(".", 1)
    return getattr(importlib.import_module(f"datatrove.pipeline.filters.{module}"), cls)(language=language)


def _decide(step, texts: list[str]) -> list[tuple[bool, str | None]]:
    from datatrove.data import Document
    from datatrove.utils.text import split_into_parts

    split_into_parts.cache_clear()  # no words left over from another run
    out = []
    for i, text in enumerate(texts):
        result = step.filter(Document(text=text, id=str(i)))
        out.append((True, None) if result is True else (False, result[1]))
    return out


def _docs_per_s(fn, texts: list[str]) -> tuple[float, list]:
    fn(texts[:20])  # warm: imports, the splitter's first build
    start = time.process_time()
    out = fn(texts)
    return len(texts) / (time.process_time() - start), out


def _real_text() -> list[str]:
    import pydoc_data.topics

    docs = list(pydoc_data.topics.topics.values())
    for path in sorted(glob.glob("/usr/share/common-licenses/*") + glob.glob("/usr/share/doc/*/copyright")):
        try:
            with open(path, encoding="utf-8") as f:
                docs.append(f.read())
        except (OSError, UnicodeDecodeError):
            pass
    docs = [d for d in docs if d.strip()]
    return docs + [p for d in docs for p in d.split("\n\n") if len(p) > 200]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--docs", type=int, default=3000)
    args = p.parse_args()
    texts = mixed_documents(args.docs, seed=1)
    try:
        import spacy  # noqa: F401

        spacy_there = True
    except ImportError:
        spacy_there = False
    real = _real_text() if spacy_there else []
    out = {"docs": len(texts), "mean_chars": round(sum(map(len, texts)) / len(texts)), "spacy": spacy_there}
    for name in F.FILTERS:
        filters = F.make_filters([name])
        ours, decided = _docs_per_s(lambda ts, f=filters: [f.check(t) for t in ts], texts)
        row = {"stoker_docs_per_s": round(ours), "removed": sum(v.text is None for v in decided)}
        if spacy_there:
            shipped_step = _datatrove(name, "eng")
            theirs, shipped = _docs_per_s(lambda ts, s=shipped_step: _decide(s, ts), texts)
            row["datatrove_spacy_docs_per_s"] = round(theirs)
            row["differ_generated"] = sum((v.text is not None) != k for v, (k, _) in zip(decided, shipped))
            ours_real = [filters.check(t).text is not None for t in real]
            shipped_real = [k for k, _ in _decide(_datatrove(name, "eng"), real)]
            row["differ_real"] = f"{sum(a != b for a, b in zip(ours_real, shipped_real))} of {len(real)}"
        out[name] = row
    chain = F.make_filters(list(F.FILTERS))
    out["all_four_docs_per_s"] = round(_docs_per_s(lambda ts: [chain.check(t) for t in ts], texts)[0])
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
