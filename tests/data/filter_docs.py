"""Documents for the quality filters' tests and benchmark (tests/data/test_filters.py,
benchmarks/bench_filters.py): English-like prose, a pure function of a seed, and documents built to
break one rule of one filter each."""

from __future__ import annotations

import random
from typing import NamedTuple

# common English words, the Gopher stop words among the first hundred; none longer than 10 letters
_WORDS = (
    "the be to of and that have with a in it for not on he as you do at this but his by from they we say her she or "
    "an will my one all would there their what so up out if about who get which go me when make can like time no "
    "just him know take people into year your good some could them see other than then now look only come its over "
    "think also back after use two how our work first well way even new want because any these give day most us "
    "river garden window market letter morning village teacher season harbor kitchen station winter summer story "
    "bridge forest engine doctor island mountain paper silver orchard meadow lantern quiet gentle careful bright "
    "early simple honest patient steady narrow ancient modern walked carried opened finished noticed remembered "
    "painted wondered followed gathered listened explained promised arrived repaired"
).split()
_DRAWN = _WORDS + "the be to of and that have with".split() * 3  # as often as in English
_CONTENT = _WORDS[100:]  # no stop word among them
_SHORT = "a an as at be by do go he if in is it me my no of on or so to up us we".split()
_LONG = "internationalization incomprehensibilities counterrevolutionaries electroencephalograph".split()


def sentence(rng: random.Random, num_words: int | None = None, words=_DRAWN) -> str:
    chosen = rng.choices(words, k=num_words or rng.randint(8, 22))
    for i in range(2, len(chosen) - 2, 7):  # a comma now and then, as prose has
        if rng.random() < 0.3:
            chosen[i] += ","
    return " ".join(chosen).capitalize() + rng.choice(".....?!")


def paragraph(rng: random.Random, num_sentences: int | None = None) -> str:
    return " ".join(sentence(rng) for _ in range(num_sentences or rng.randint(3, 7)))


def prose(rng: random.Random, num_paragraphs: int | None = None) -> str:
    """A normal English document: paragraphs of sentences, one paragraph a line (as web text
    extracted by trafilatura reads), a blank line between them."""
    return "\n\n".join(paragraph(rng) for _ in range(num_paragraphs or rng.randint(3, 8)))


class RuleCase(NamedTuple):
    filter: str
    code: str  # datatrove's drop code for the rule the text breaks
    text: str
    # parameters that turn that rule off, after which the filter keeps the text: so it breaks that
    # rule and no other (where a rule implies another, as a repeated paragraph is repeated lines,
    # both are turned off)
    rule_off: dict
    params: dict = {}  # the filter's parameters, for both runs


def rule_cases(seed: int = 0) -> list[RuleCase]:
    """For each rule of each filter, a document that breaks it."""
    rng = random.Random(seed)
    lines = [sentence(rng, 14) for _ in range(12)]
    # '#' or '...' over 0.1 of the words, the words with a letter still over 80%
    hashtags = "\n".join(
        " ".join(rng.choices(_DRAWN, k=20) + [f"#{w}" for w in rng.sample(_CONTENT, 3)]) + "." for _ in range(12)
    )
    ellipses = "\n".join(" ... ".join(" ".join(rng.choices(_DRAWN, k=5)) for _ in range(4)) + "." for _ in range(12))
    unique_x = rng.sample(_CONTENT, 40)
    long_unique = [sentence(rng, 30) for _ in range(10)]
    long_line = sentence(rng, 60)
    phrase = " ".join(rng.sample(_CONTENT, 20))
    return [
        RuleCase(
            "gopher_quality",
            "gopher_short_doc",
            "The teacher walked along the river to the market, and noticed that the lanterns were lit.",
            {"min_doc_words": None},
        ),
        RuleCase("gopher_quality", "gopher_long_doc", prose(rng, 4), {"max_doc_words": None}, {"max_doc_words": 100}),
        RuleCase(
            "gopher_quality", "gopher_below_avg_threshold", sentence(rng, 80, _SHORT), {"min_avg_word_length": None}
        ),
        RuleCase(
            "gopher_quality",
            "gopher_above_avg_threshold",
            " ".join((_LONG + ["of the"]) * 15) + ".",
            {"max_avg_word_length": None},
        ),
        RuleCase("gopher_quality", "gopher_too_many_hashes", hashtags, {"max_symbol_word_ratio": None}),
        RuleCase("gopher_quality", "gopher_too_many_ellipsis", ellipses, {"max_symbol_word_ratio": None}),
        RuleCase(
            "gopher_quality",
            "gopher_too_many_bullets",
            "\n".join("- " + s for s in lines),
            {"max_bullet_lines_ratio": None},
        ),
        RuleCase(
            "gopher_quality",
            "gopher_too_many_end_ellipsis",
            "\n".join(s[:-1] + "..." if i % 2 else s for i, s in enumerate(lines)),
            {"max_ellipsis_lines_ratio": None},
        ),
        RuleCase(
            "gopher_quality",
            "gopher_below_alpha_threshold",
            paragraph(rng, 2)
            + " It is the end of that story. "
            + " ".join(str(rng.randint(10, 9999)) for _ in range(100))
            + ".",
            {"max_non_alpha_words_ratio": None},
        ),
        RuleCase(
            "gopher_quality",
            "gopher_enough_stop_words",
            " ".join(sentence(rng, 15, _CONTENT) for _ in range(8)),
            {"min_stop_words": None},
        ),
        RuleCase(
            "gopher_repetition",
            "dup_para_frac",
            "\n\n".join(["Read more."] * 4 + ["\n".join(sentence(rng, 15) for _ in range(10)) for _ in range(5)]),
            {"dup_para_frac": None},
        ),
        RuleCase(
            "gopher_repetition",
            "dup_para_char_frac",
            "\n\n".join(
                [lines[0] + " " + lines[1]] + [sentence(rng, 5) for _ in range(7)] + [lines[0] + " " + lines[1]]
            ),
            {"dup_para_char_frac": None, "dup_line_char_frac": None, "dup_n_grams": []},
        ),
        RuleCase(
            "gopher_repetition",
            "dup_line_frac",
            "\n".join(x for s in long_unique[:6] for x in (s, "Share this.")),
            {"dup_line_frac": None},
        ),
        RuleCase(
            "gopher_repetition",
            "dup_line_char_frac",
            "\n".join([long_line] + lines[1:9] + [long_line]),
            {"dup_line_char_frac": None, "dup_n_grams": []},
        ),
        RuleCase(
            "gopher_repetition",
            "top_2_gram",
            " ".join(f"of the {x}" for x in unique_x) + ".",
            {"top_n_grams": [[3, 0.18], [4, 0.16]]},
        ),
        RuleCase(
            "gopher_repetition",
            "duplicated_5_n_grams",
            " ".join([sentence(rng, 40)[:-1], phrase, phrase, phrase]) + ".",
            {"dup_n_grams": []},
        ),
        RuleCase(
            "c4",
            "lorem_ipsum",
            prose(rng, 3) + "\nLorem ipsum dolor sit amet, consectetur adipiscing elit.",
            {"filter_lorem_ipsum": False},
        ),
        RuleCase(
            "c4",
            "curly_bracket",
            prose(rng, 3) + "\nThe function f(x) { return x + 1; } adds one.",
            {"filter_curly_bracket": False},
        ),
        RuleCase("c4", "too_few_sentences", " ".join(sentence(rng, 25) for _ in range(3)), {"min_num_sentences": 3}),
        RuleCase("fineweb_quality", "empty", "\n \n", {}),  # no rule turns this one off
        RuleCase(
            "fineweb_quality",
            "line_punct_ratio",
            "\n".join(s[:-1] for s in lines[:10]) + "\n" + lines[10],
            {"line_punct_thr": 0},
        ),
        RuleCase(
            "fineweb_quality",
            "short_line_ratio",
            "\n".join(sentence(rng, 4, _SHORT) for _ in range(20)) + "\n" + paragraph(rng, 5),
            {"short_line_thr": 1},
        ),
        RuleCase("fineweb_quality", "char_dup_ratio", "\n".join(lines[:8] + [lines[0]]), {"char_duplicates_ratio": 1}),
        RuleCase(
            "fineweb_quality", "list_ratio", "\n".join(f"{a} {b}." for a in _LONG for b in _LONG), {"new_line_ratio": 1}
        ),
    ]


def mixed_documents(num_docs: int, seed: int = 0) -> list[str]:
    """Mostly prose, a quarter of it the rule cases' documents, in a seeded order."""
    rng = random.Random(seed)
    junk = [case.text for case in rule_cases(seed)]
    return [prose(rng) if rng.random() < 0.75 else rng.choice(junk) for _ in range(num_docs)]


def threshold_sweeps(seed: int = 0) -> list[str]:
    """Documents on both sides of each published threshold (words, bullets, ellipses, letters,
    repeated lines and paragraphs, sentences, punctuated and short lines): where a filter that
    drifted from its published value would decide differently."""
    rng = random.Random(seed)
    lines = [sentence(rng, 12) for _ in range(20)]
    more = [sentence(rng, 12) for _ in range(30)]
    wide = _LONG + sorted(_CONTENT, key=len)[-16:]
    docs = [" ".join(sentence(rng, 10) for _ in range(k)) for k in range(3, 8)]  # ~40 to ~80 words, 3 to 7 sentences
    for k in range(0, 21, 2):  # k of 20 lines bulleted, cut short with '...', without a full stop, short
        docs.append("\n".join("- " + s if i < k else s for i, s in enumerate(lines)))
        docs.append("\n".join(s[:-1] + "..." if i < k else s for i, s in enumerate(lines)))
        docs.append("\n".join(s if i < k else s[:-1] for i, s in enumerate(lines)))
        docs.append("\n".join("Yes it is so." if i < k else s for i, s in enumerate(lines)))
        docs.append("\n".join(lines[0] if i < k else s for i, s in enumerate(lines)))  # repeated lines
        docs.append("\n\n".join(lines[0] if i < k else s for i, s in enumerate(lines)))  # repeated paragraphs
        docs.append(" ".join(lines[:8]) + " " + " ".join(str(rng.randint(10, 99)) for _ in range(4 * k)) + ".")
        docs.append(" ".join(lines[:6]) + " " + " ".join(rng.choice(_LONG) for _ in range(5 * k)) + ".")  # word length
        docs.append(" ".join(s + " #river #garden" * (i < k) for i, s in enumerate(lines)))  # '#' per word
        docs.append("\n".join(" ".join(rng.sample(wide, 1 + k // 4)) + "." for _ in range(20)))  # words per line
        docs.append("\n".join(lines[:4] + [f"Item {i} in the list, {k} of them." for i in range(k)]))  # ~30 characters
        docs.append("\n".join(more[: 10 + k] + ["Read more now."] * 2))  # a repeated line, ~1% of the characters
    extra = [  # lines that c4 drops, and one it cuts
        "Please enable JavaScript to view the comments.",
        "Read our privacy policy and the terms of use.",
        "A line with a long word " + "y" * 900 + " in it.",
        "Yes it is.",
        "Four words are here.",
        "A fact was cited here.[1] Another one too.[citation needed]",
        "Share this.",
    ]
    docs += ["\n".join(lines[:6] + extra[:i] + lines[6:12]) for i in range(len(extra) + 1)]
    return docs
