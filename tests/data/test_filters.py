"""stoker.data.filters: each rule of each published filter removes the document built to break it
(and only that rule: turned off, the document is kept), normal English is kept, parameters
override the published defaults, a bad spec is one ConfigError line per problem naming
data.filters, and the decisions are datatrove's own filters' (so the wrapper cannot drift)."""

from __future__ import annotations

import importlib
import inspect
import json
import pickle
import random
import warnings

import pytest

from stoker.data import filters as F
from stoker.data.filters import FILTERS, Verdict, make_filters, sentence_spans, words
from stoker.failures import ConfigError
from tests.data.filter_docs import mixed_documents, paragraph, prose, rule_cases, sentence, threshold_sweeps


@pytest.mark.parametrize("case", rule_cases(), ids=lambda c: f"{c.filter}-{c.code}")
def test_each_rule_removes_the_document_built_to_break_it_and_only_that_rule(case):
    removed = make_filters([{"name": case.filter, **case.params}]).check(case.text)
    assert removed.text is None and removed.removed_by == case.filter
    assert removed.reason.endswith(f"({case.code})")
    if case.rule_off:  # every other rule of the filter keeps it
        kept = make_filters([{"name": case.filter, **case.params, **case.rule_off}]).check(case.text)
        assert kept.removed_by is None and kept.text, kept.reason


def test_the_reason_says_the_rule_with_its_parameter():
    text = "The teacher walked along the river to the market, and noticed that the lanterns were lit."
    assert make_filters(["gopher_quality"]).check(text) == (
        None,
        "gopher_quality",
        "fewer than 50 words (gopher_short_doc)",
    )
    assert (
        make_filters([{"name": "gopher_quality", "min_doc_words": 30}])
        .check(text)
        .reason.startswith("fewer than 30 words")
    )


@pytest.mark.parametrize("seed", range(5))
def test_normal_english_is_kept_by_every_filter(seed):
    for text in (prose(random.Random(seed)), paragraph(random.Random(seed), 6)):
        for name in FILTERS:
            verdict = make_filters([name]).check(text)
            assert verdict.removed_by is None, (name, verdict.reason)
            # c4 keeps every line of it (it joins the lines kept with one line break)
            assert verdict.text == (text.replace("\n\n", "\n") if name == "c4" else text)
        assert make_filters(list(FILTERS)).check(text).text == text.replace("\n\n", "\n")


def test_c4_drops_the_lines_it_does_not_keep_and_returns_the_rest():
    rng = random.Random(0)
    keep = [paragraph(rng, 3), paragraph(rng, 3)]
    text = "\n".join(
        [
            "Home",  # no terminal punctuation
            keep[0],
            "Products and services",
            "Please enable JavaScript to see the rest of this page.",
            "This site uses cookies to improve your experience.",
            "Too short.",
            "A line with a word " + "x" * 1001 + " in it.",
            keep[1] + "[1]",  # a citation mark is cut, the line kept
        ]
    )
    assert make_filters(["c4"]).check(text) == Verdict("\n".join(keep))
    # as FineWeb ran it: lines without terminal punctuation stay
    fineweb_c4 = make_filters([{"name": "c4", "filter_no_terminal_punct": False}]).check(text)
    assert fineweb_c4.text == "\n".join([keep[0], "Products and services", keep[1]])


def test_filters_run_in_order_and_later_ones_see_the_text_c4_kept():
    rng = random.Random(1)
    menu = "\n".join(f"Menu entry {i} of the site navigation bar" for i in range(40))
    text = paragraph(rng, 6) + "\n" + menu  # most lines lack terminal punctuation
    assert make_filters(["fineweb_quality"]).check(text).reason.endswith("(line_punct_ratio)")
    kept = make_filters(["c4", "fineweb_quality"]).check(text)
    assert kept.removed_by is None and "Menu" not in kept.text
    both_fail = sentence(rng, 12) + "\nHome\nAbout\nContact"  # too short and too many short lines
    assert make_filters(["fineweb_quality", "gopher_quality"]).check(both_fail).removed_by == "fineweb_quality"
    assert make_filters(["gopher_quality", "fineweb_quality"]).check(both_fail).removed_by == "gopher_quality"


def test_parameters_override_the_published_defaults():
    text = prose(random.Random(2), 3)
    assert (
        make_filters([{"name": "gopher_quality", "max_doc_words": 50}]).check(text).reason.endswith("(gopher_long_doc)")
    )
    no_stop = make_filters([{"name": "gopher_quality", "stop_words": ["zebra", "quagga"]}]).check(text)
    assert no_stop.reason == "fewer than 2 of the stop words (gopher_enough_stop_words)"
    repeated = " ".join(["the river"] * 10) + " " + text
    assert make_filters(["gopher_repetition"]).check(repeated).removed_by is None
    strict = make_filters([{"name": "gopher_repetition", "top_n_grams": [[2, 0.05]]}]).check(repeated)
    assert strict.reason == "the commonest 2-gram covers over 5% of the characters (top_2_gram)"
    rng = random.Random(3)
    lines = "\n".join(sentence(rng, 12)[:-1] + ";" for _ in range(10))  # no line ends in . ? !
    assert make_filters(["fineweb_quality"]).check(lines).removed_by == "fineweb_quality"
    assert make_filters([{"name": "fineweb_quality", "stop_chars": [";"]}]).check(lines).removed_by is None


def test_the_published_defaults_are_datatroves():
    from datatrove.pipeline.filters.gopher_quality_filter import STOP_WORDS

    steps = {name: F._CLASSES[name].rsplit(".", 1) for name in FILTERS}
    for name, (module, cls) in steps.items():
        step = getattr(importlib.import_module(f"datatrove.pipeline.filters.{module}"), cls)
        defaults = {
            k: p.default
            for k, p in inspect.signature(step.__init__).parameters.items()
            if k not in ("self", "exclusion_writer", "language")
        }
        defaults = {k: tuple(STOP_WORDS) if k == "stop_words" else v for k, v in defaults.items()}
        assert defaults == FILTERS[name], name
    # the numbers of the papers, as issue 51 cites them
    gq, gr, c4, fw = (FILTERS[name] for name in ("gopher_quality", "gopher_repetition", "c4", "fineweb_quality"))
    assert [gq[k] for k in list(gq)[:9]] == [50, 100000, 3, 10, 0.1, 0.9, 0.3, 0.8, 2]
    assert [gr[k] for k in list(gr)[:4]] == [0.3, 0.3, 0.2, 0.2] and gr["top_n_grams"] == (
        (2, 0.2),
        (3, 0.18),
        (4, 0.16),
    )
    assert gr["dup_n_grams"] == tuple(zip(range(5, 11), (0.15, 0.14, 0.13, 0.12, 0.11, 0.10)))
    assert (c4["min_num_sentences"], c4["min_words_per_line"], c4["max_word_length"]) == (5, 3, 1000)
    assert [
        fw[k]
        for k in ("line_punct_thr", "short_line_thr", "short_line_length", "char_duplicates_ratio", "new_line_ratio")
    ] == [0.12, 0.67, 30, 0.01, 0.3]


def _datatrove_decides(step, text: str) -> Verdict:
    from datatrove.data import Document

    doc = Document(text=text, id="0")
    result = step.filter(doc)
    return Verdict(doc.text) if result is True else Verdict(None, None, result[1])


def test_the_decisions_are_datatroves_own_filters_on_mixed_documents():
    """datatrove's filters built here with their own defaults (and stoker's word splitter, which
    they are given in stoker too) decide every document as Filters does, text kept included."""
    from datatrove.pipeline.filters import (
        C4QualityFilter,
        FineWebQualityFilter,
        GopherQualityFilter,
        GopherRepetitionFilter,
    )

    own = {
        "gopher_quality": GopherQualityFilter,
        "gopher_repetition": GopherRepetitionFilter,
        "c4": C4QualityFilter,
        "fineweb_quality": FineWebQualityFilter,
    }
    docs = mixed_documents(150, seed=4) + [case.text for case in rule_cases(5)] + threshold_sweeps(6)
    removed = 0
    for name, cls in own.items():
        ours, theirs = make_filters([name]), cls(language=F._words())
        for text in docs:
            got, want = ours.check(text), _datatrove_decides(theirs, text)
            assert got.text == want.text, (name, text[:80])
            assert got.reason is None if want.reason is None else got.reason.endswith(f"({want.reason})")
            removed += got.text is None
    assert 0.05 * len(docs) < removed / len(own) < 0.5 * len(docs)  # the set is mixed


# what spaCy's English tokenizer (spacy.blank("en"), datatrove's English default) makes of these
SPACY_WORDS = {
    "It's 3.5 km, 1,000 people; 10:30 a.m. and/or $100 #tag COVID-19 2000-2020 well-known.": [
        "It", "'s", "3.5", "km", ",", "1,000", "people", ";", "10:30", "a.m.", "and/or", "$", "100", "#", "tag",
        "COVID-19", "2000", "-", "2020", "well", "-", "known", ".",
    ],
    'Mr. Smith (U.S.A.) e.g. J. R. Tolkien said: "Don\'t!" They\'re I\'m can\'t O\'Brien James\' book.': [
        "Mr.", "Smith", "(", "U.S.A.", ")", "e.g.", "J.", "R.", "Tolkien", "said", ":", '"', "Do", "n't", "!", '"',
        "They", "'re", "I", "'m", "ca", "n't", "O'Brien", "James", "'", "book", ".",
    ],
    "See https://example.com/a/b?x=1. Mail john.doe@example.org, or www.example.com! file.txt end.Next": [
        "See", "https://example.com/a/b?x=1", ".", "Mail", "john.doe@example.org", ",", "or", "www.example.com", "!",
        "file.txt", "end", ".", "Next",
    ],
    "-- word--word ... wait... what?! :) foo_bar x=y 1/2 3+4 USA. A. v2.0 “Quoted” (paren) {curly}": [
        "--", "word", "--", "word", "...", "wait", "...", "what", "?", "!", ":)", "foo_bar", "x", "=", "y", "1/2",
        "3", "+", "4", "USA", ".", "A.", "v2.0", "“", "Quoted", "”", "(", "paren", ")", "{", "curly", "}",
    ],
    "You cannot see it: a. the list, b. the ''quote'' under Apache-2.0 or LGPL-2.1 today.": [
        "You", "can", "not", "see", "it", ":", "a.", "the", "list", ",", "b.", "the", "''", "quote", "''", "under",
        "Apache-2.0", "or", "LGPL-2.1", "today", ".",
    ],
}  # fmt: skip


@pytest.mark.parametrize("text", SPACY_WORDS)
def test_words_are_split_as_spacys_english_tokenizer_splits_them(text):
    assert words(text) == SPACY_WORDS[text]


def test_the_table_is_what_spacy_says_where_spacy_is_installed():
    spacy = pytest.importorskip("spacy")  # not a dependency: datatrove's English default, measured against
    nlp = spacy.blank("en")
    assert {t: [w.text for w in nlp.tokenizer(t) if w.text.strip()] for t in SPACY_WORDS} == SPACY_WORDS


def test_a_sentence_ends_at_terminal_punctuation_once_a_word_follows():
    text = 'He said "Stop." Then he left! Did he? e.g. this stays whole... and 3.5 too. End'
    assert [text[a:b] for a, b in sentence_spans(text)] == [
        'He said "Stop."',
        "Then he left!",
        "Did he?",
        "e.g. this stays whole... and 3.5 too.",
        "End",
    ]
    assert sentence_spans("") == [] and sentence_spans("no end") == [(0, 6)]


def test_a_bad_spec_is_one_config_error_with_a_line_per_problem_naming_data_filters():
    spec = [
        "gopher_qualty",
        {"name": "c4", "min_sentences": 3, "filter_policy": None},
        {"name": "fineweb_quality", "line_punct_thr": "high"},
        {"name": "gopher_quality", "min_doc_words": 5.5, "stop_words": "the"},
        {"name": "gopher_repetition", "top_n_grams": [[2]]},
        {"min_doc_words": 5},
        "c4",
    ]
    with pytest.raises(ConfigError) as err:
        make_filters(spec)
    problems = err.value.problems
    assert [p.split(":")[0] for p in problems] == [
        "data.filters[0]", "data.filters[1] (c4)", "data.filters[1] (c4)", "data.filters[2] (fineweb_quality)",
        "data.filters[3] (gopher_quality)", "data.filters[3] (gopher_quality)", "data.filters[4] (gopher_repetition)",
        "data.filters[5]", "data.filters[6]",
    ]  # fmt: skip
    assert all("\n" not in p for p in problems)
    assert (
        "'gopher_qualty' is not a filter; use one of gopher_quality, gopher_repetition, c4, fineweb_quality"
        in problems[0]
    )
    assert "'min_sentences' is not one of its parameters; use split_paragraph, " in problems[1]
    assert "min_num_sentences" in problems[1] and "filter_policy=None cannot be null" in problems[2]
    assert "line_punct_thr='high' should be a number" in problems[3]
    assert "min_doc_words=5.5 should be a whole number" in problems[4] and "should be a list of strings" in problems[5]
    assert "[n, fraction] pairs" in problems[6]
    assert "has no 'name'; give one of gopher_quality" in problems[7] and "'c4' is listed twice" in problems[8]


def test_filters_pickle_as_their_spec_and_decide_the_same():
    filters = make_filters([{"name": "c4", "min_num_sentences": 3}, "gopher_quality"])
    docs = mixed_documents(40, seed=6)
    before = [filters.check(text) for text in docs]
    again = pickle.loads(pickle.dumps(filters))
    assert again._steps is None and again.spec == filters.spec  # datatrove's objects are built anew
    assert [again.check(text) for text in docs] == before
    spec = json.loads(json.dumps(filters.spec))
    assert spec[0] == {"name": "c4", **FILTERS["c4"], "min_num_sentences": 3}
    assert spec[1]["stop_words"] == ["the", "be", "to", "of", "and", "that", "have", "with"]
    assert make_filters(spec).spec == spec  # a spec written out reads back as itself
    assert filters.implementation.startswith("datatrove==0.10.1 ")


def test_no_filters_keep_every_text_as_it_is_and_a_text_without_words_is_removed():
    assert make_filters([]).check("  any\n\ntext ") == Verdict("  any\n\ntext ")
    assert len(make_filters(None)) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # numpy: the mean length of no words
        verdict = make_filters([{"name": "gopher_quality", "min_doc_words": None}]).check("   ")
    assert verdict == Verdict(None, "gopher_quality", "no words")
