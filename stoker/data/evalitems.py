"""The evaluation items a run scores, as text, for data.decontaminate.

The vendored multiple-choice set (stoker/evalsets/stdlib-continuations.jsonl) when eval.sets
holds 'multiple_choice' or eval.harness_tasks names 'stoker_mc'; and every other task of
eval.harness_tasks read from its YAML in eval.harness_include (local JSON-lines files only, as
`stoker harness` runs them). An item's text is its context followed by its true ending: what
a model that saw it in training would have memorised. Every item of a set counts, not only the
first eval.multiple_choice_items: a later run may score more of them.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import dataclass

from stoker.config import EvalConfig
from stoker.failures import DataError

VENDORED_SET = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "evalsets", "stdlib-continuations.jsonl"
)
VENDORED_TASK = "stoker_mc"


@dataclass(frozen=True)
class EvalItem:
    id: str  # "stoker_mc:12": the set (or task) and the item's number in it
    text: str


def _vendored_items() -> list[EvalItem]:
    items = []
    with open(VENDORED_SET, encoding="utf-8") as f:
        for line in f:
            record = json.loads(line)
            if "meta" in record:
                continue
            text = record["context"] + record["endings"][record["label"]]
            items.append(EvalItem(f"{VENDORED_TASK}:{record['id']}", text))
    return items


def _task_yaml(task: str, folders: list[str]) -> tuple[str, dict] | None:
    import yaml

    for folder in folders:
        for path in sorted(glob.glob(os.path.join(os.path.expanduser(folder), "**", "*.yaml"), recursive=True)):
            try:
                with open(path, encoding="utf-8") as f:
                    spec = yaml.load(f, Loader=yaml.BaseLoader)  # '!function' tags stay unread
            except (OSError, yaml.YAMLError):
                continue
            if isinstance(spec, dict) and spec.get("task") == task:
                return path, spec
    return None


def _unreadable(task: str, why: str) -> DataError:
    return DataError(
        f"data.decontaminate: eval.harness_tasks names {task!r}, whose items cannot be read to check "
        f"the training data against ({why}); give it as a local JSON-lines task in eval.harness_include "
        "(dataset_path: json, dataset_kwargs.data_files), or set data.decontaminate false."
    )


def _data_files(task: str, path: str, spec: dict) -> list[str]:
    files = (
        (spec.get("dataset_kwargs") or {}).get("data_files") if isinstance(spec.get("dataset_kwargs"), dict) else None
    )
    if spec.get("dataset_path") != "json" or not files:
        raise _unreadable(task, f"{path} does not read local JSON files")
    named = list(files.values()) if isinstance(files, dict) else files
    flat = [p for v in (named if isinstance(named, list) else [named]) for p in (v if isinstance(v, list) else [v])]
    out = [os.path.join(os.path.dirname(path), os.path.expanduser(p)) for p in flat]
    missing = [p for p in out if not os.path.isfile(p)]
    if missing:
        raise _unreadable(task, f"{missing[0]} is not a file")
    return out


def _item_text(record: dict, spec: dict) -> str:
    """doc_to_text's field and the true choice when the YAML names plain fields; else every
    string of the record (a template we do not render: the words are the same)."""
    text, choices, target = (spec.get(k) for k in ("doc_to_text", "doc_to_choice", "doc_to_target"))
    if isinstance(record.get(text), str):
        out = record[text]
        options = record.get(choices)
        label = record.get(target)
        if isinstance(options, list) and isinstance(label, int) and 0 <= label < len(options):
            out += str(options[label])
        return out
    return " ".join(str(v) for v in record.values() if isinstance(v, (str, list)))


def _harness_items(task: str, folders: list[str]) -> list[EvalItem]:
    found = _task_yaml(task, folders)
    if found is None:
        raise _unreadable(task, "no YAML of eval.harness_include defines it")
    path, spec = found
    items = []
    for data_file in _data_files(task, path, spec):
        with open(data_file, encoding="utf-8") as f:
            for number, line in enumerate(f):
                if line.strip():
                    items.append(EvalItem(f"{task}:{number}", _item_text(json.loads(line), spec)))
    return items


def eval_items(evaluation: EvalConfig) -> list[EvalItem]:
    """Every item of the evaluation sets the run scores, each set once, in a fixed order."""
    items: list[EvalItem] = []
    tasks = list(dict.fromkeys(evaluation.harness_tasks))
    if "multiple_choice" in evaluation.sets or VENDORED_TASK in tasks:
        items += _vendored_items()
    for task in tasks:
        if task != VENDORED_TASK:
            items += _harness_items(task, list(evaluation.harness_include))
    return items


def items_fingerprint(items: list[EvalItem]) -> str:
    """The content of a list of items, for the dedup cache key."""
    h = hashlib.sha256()
    for item in items:
        h.update(json.dumps([item.id, item.text]).encode())
    return h.hexdigest()[:24]
