"""Build stoker's vendored multiple-choice set from the built-in corpus (builtin:stdlib).

    python scripts/build_evalset.py                 # rewrites stoker/evalsets/stdlib-continuations.jsonl
    python scripts/build_evalset.py --out x.jsonl   # writes elsewhere (the tests compare the bytes)

HellaSwag-style completion ranking, built the simplest license-clear way: every item is a
passage of a Python standard-library source file (the text stoker's built-in corpus is made
of), its true next line, and three next lines of passages elsewhere (other files), so a model
must know which line follows to pick it.

- Sources: the files of SOURCE_FILES, all of which sort after the point where the default
  data.max_bytes (3 MB) stops reading the sorted standard library: a run on the defaults never
  trained on them.
- An ending is one line whose content (indentation left out) is ENDING_CHARS long and holds
  at least MIN_LETTERS letters (no docstring quotes, no lines of one repeated character); its
  context is the whole lines before it, at least CONTEXT_CHARS characters. Endings of one file
  are at least GAP_LINES lines apart, so no context holds another item's ending.
- The three distractors are the next lines of passages in other files whose content is
  closest in length to the true one (drawn among the LENGTH_POOL closest), indented as the
  true one: neither the length nor the indentation tells the answer.
- Every random choice comes from generators seeded with SEED and the file's name, so the same
  standard library gives the same bytes; the first line of the file (``{"meta": ...}``) names
  the Python version and the sha256 of every source file it was built from.

The file's sha256 is stoker.training.scoring.MULTIPLE_CHOICE_SHA256: after a rebuild, put the
new one there (the tests check that this script reproduces the vendored file byte for byte).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import sysconfig

SEED = "stoker-multiple-choice-v1"
SOURCE_FILES = (
    "sched.py",
    "selectors.py",
    "shlex.py",
    "shutil.py",
    "smtplib.py",
    "socket.py",
    "statistics.py",
    "string.py",
    "subprocess.py",
    "tarfile.py",
    "tempfile.py",
    "textwrap.py",
    "threading.py",
    "tokenize.py",
    "traceback.py",
    "typing.py",
    "uuid.py",
    "warnings.py",
    "weakref.py",
    "zipfile.py",
)
NUM_ITEMS = 500
CONTEXT_CHARS = 200
ENDING_CHARS = (24, 72)
MIN_LETTERS = 8
GAP_LINES = 24
LENGTH_POOL = 12
NUM_ENDINGS = 4
OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "stoker", "evalsets")
FILE_NAME = "stdlib-continuations.jsonl"
LICENSE = (
    "The passages are excerpts of the CPython standard library: Copyright (c) 2001-2023 Python "
    "Software Foundation; All Rights Reserved. Distributed under the PSF License Agreement "
    "version 2 (the LICENSE.txt of the Python distribution the set was built from)."
)


def _rng(*parts: str) -> random.Random:
    seed = hashlib.sha256(":".join((SEED, *parts)).encode()).digest()
    return random.Random(int.from_bytes(seed[:8], "little"))


def _good_ending(line: str) -> bool:
    content = line.strip()
    return (
        ENDING_CHARS[0] <= len(content) <= ENDING_CHARS[1]
        and sum(c.isalpha() for c in content) >= MIN_LETTERS
        and '"""' not in content
        and "'''" not in content
        and len(set(content.replace(" ", ""))) > 2
    )


def passages(name: str, text: str) -> list[dict]:
    """Every (context, true ending) pair one file gives, in the order its generator drew them."""
    lines = text.splitlines(keepends=True)
    starts, size = [], 0  # starts[i]: characters before line i
    for line in lines:
        starts.append(size)
        size += len(line)
    candidates = [i for i, line in enumerate(lines) if starts[i] >= CONTEXT_CHARS and _good_ending(line)]
    rng = _rng(name)
    rng.shuffle(candidates)
    chosen: list[int] = []
    for i in candidates:
        if all(abs(i - j) >= GAP_LINES for j in chosen):
            chosen.append(i)
    out = []
    for i in chosen:
        first = max(j for j in range(i) if starts[i] - starts[j] >= CONTEXT_CHARS)
        ending = lines[i].rstrip("\r\n")
        out.append(
            {
                "source": f"{name}:{i + 1}",
                "context": "".join(lines[first:i]),
                "indent": ending[: len(ending) - len(ending.lstrip())],
                "content": ending.strip(),
            }
        )
    return out


def build(stdlib: str) -> tuple[bytes, dict]:
    """The set's bytes, and its meta record."""
    names = sorted(n for n in SOURCE_FILES if os.path.isfile(os.path.join(stdlib, n)))
    texts, hashes = {}, {}
    for name in names:
        with open(os.path.join(stdlib, name), "rb") as f:
            data = f.read()
        hashes[name] = hashlib.sha256(data).hexdigest()
        texts[name] = data.decode("utf-8")
    drawn = {name: passages(name, texts[name]) for name in names}
    found: list[dict] = []  # round robin over the files, so each gives about as many
    for k in range(max(map(len, drawn.values()))):
        found += [dict(drawn[name][k], file=name) for name in names if k < len(drawn[name])]
    found = sorted(found[:NUM_ITEMS], key=lambda p: (p["file"], int(p["source"].rsplit(":", 1)[1])))
    items = []
    for k, item in enumerate(found):
        true = item["content"]
        others = sorted(
            {p["content"] for p in found if p["file"] != item["file"] and p["content"] != true},
            key=lambda c: (abs(len(c) - len(true)), c),
        )
        rng = _rng(item["source"])
        distractors = rng.sample(others[:LENGTH_POOL], NUM_ENDINGS - 1)
        label = rng.randrange(NUM_ENDINGS)
        endings = [item["indent"] + c for c in distractors[:label] + [true] + distractors[label:]]
        items.append(
            {"id": k, "source": item["source"], "context": item["context"], "endings": endings, "label": label}
        )
    meta = {
        "name": "stdlib-continuations",
        "version": 1,
        "built_by": "python scripts/build_evalset.py",
        "corpus": "builtin:stdlib",
        "python": sys.version.split()[0],
        "files": hashes,
        "num_items": len(items),
        "how": "context: whole lines of a standard-library file (>= %d chars); endings: its true next line "
        "and the next lines of 3 passages in other files, closest in length, indented as the true one; "
        "label: the index of the true one" % CONTEXT_CHARS,
        "license": LICENSE,
    }
    lines = [json.dumps({"meta": meta}, sort_keys=True)] + [json.dumps(i, sort_keys=True) for i in items]
    return ("\n".join(lines) + "\n").encode("ascii"), meta


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Build stoker's multiple-choice set from the standard library.")
    p.add_argument("--out", default=os.path.join(OUT, FILE_NAME))
    p.add_argument("--stdlib", default=sysconfig.get_paths()["stdlib"], help="the standard library's folder")
    args = p.parse_args(argv)
    data, meta = build(args.stdlib)
    with open(args.out, "wb") as f:
        f.write(data)
    print(f"{args.out}: {meta['num_items']} items, sha256 {hashlib.sha256(data).hexdigest()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
