"""'builtin:contracts': a small synthetic domain corpus that ships with stoker, for trying a
mixture, an anneal on the domain and gain-and-forgetting reports without downloading anything
(the way 'builtin:stdlib' is the general text that is always there).

400 short commercial agreements of template clauses (parties, obligations, notice periods,
governing law), about 1.6 MB, the same bytes on every machine: a pure function of a fixed seed,
written once into the data stage's work folder and fingerprinted by content like any local
folder. It is text for demonstrations and tests, not a corpus worth training a model on.
"""

from __future__ import annotations

import os
import random

CONTRACTS_SOURCE = "builtin:contracts"
_SUBJECTS = ("The Lessee", "The Lessor", "Each party", "The Contractor", "The Company", "Either party", "The Purchaser")
_VERBS = (
    "shall indemnify",
    "shall give written notice to",
    "may terminate this Agreement with",
    "shall not assign any rights to",
    "shall pay all amounts due to",
    "warrants to",
)
_OBJECTS = ("the other party", "the Lessor", "any third party", "the Purchaser", "its affiliates")
_TAILS = (
    "within thirty (30) days of receipt of an invoice",
    "pursuant to Section {n}",
    "subject to the limitations in Article {m}",
    "in accordance with the laws of the State of Delaware",
    "notwithstanding anything to the contrary herein",
    "except as otherwise provided in Clause {n}",
)


def write_contracts(folder: str, count: int = 400, seed: int = 0) -> str:
    """Write the corpus into `folder` (one .txt a contract) unless it is there; returns it."""
    done = os.path.join(folder, ".complete")
    if os.path.exists(done):
        return folder
    os.makedirs(folder, exist_ok=True)
    rng = random.Random(seed)
    for i in range(count):
        clauses = []
        for _ in range(rng.randint(4, 12)):
            tail = rng.choice(_TAILS).format(n=rng.randint(1, 40), m=rng.choice("IVX"))
            clauses.append(f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {tail}.")
        with open(os.path.join(folder, f"contract-{i:03d}.txt"), "w") as f:
            f.write(f"AGREEMENT No. {1000 + i}\n\n" + " ".join(clauses) + "\n")
    open(done, "w").close()
    return folder
