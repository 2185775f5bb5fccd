"""data.filters: the published heuristic quality filters, by their published names and parameters.

    gopher_quality     Rae et al. 2021 (Gopher, MassiveText), section A.1.1 and Table A1
    gopher_repetition  Rae et al. 2021, the repetition removal of Table A1
    c4                 Raffel et al. 2020 (C4), section 2.2, as the TFDS c4_utils code runs it
    fineweb_quality    Penedo et al. 2024 (FineWeb), its custom filters

Each is datatrove's own filter (datatrove==0.10.1, ``datatrove/pipeline/filters/``:
GopherQualityFilter, GopherRepetitionFilter, C4QualityFilter, FineWebQualityFilter), used as a
library with its published defaults, which FILTERS repeats (a test holds the two equal, another
holds our decisions equal to those classes' own). One thing is stoker's: the word splitter.
datatrove 0.10.1 splits English with spaCy (spacy.blank("en"): no NLTK, no data download), but
spaCy is no dependency of datatrove's, its import takes ~4 s and imports torch (thinc asks CUDA
for its devices) in every data worker, and datatrove's spaCy wrapper ran 130-235 documents/s per
filter where the same filters with the splitter below run 490-3200 (benchmarks/bench_filters.py).
So stoker passes each filter ``words``/``sentence_spans`` below as its tokenizer (datatrove's own
hook: `language` takes a WordTokenizer): spaCy's English rules where they move these counts
(punctuation apart from words, "..." one word, URLs and e-mail addresses whole, 3.5 and 1,000
whole, do|n't, it|'s, can|not, U.S. and Mr. and a. whole) and spaCy's sentencizer rule for C4.
Measured against datatrove with spaCy: the same decision on every generated document, and on
99.0% (gopher_quality), 99.6% (gopher_repetition) and 100% (c4, fineweb_quality) of 16,694
documents of real English full of code and markup. The papers never fixed a splitter either:
Gopher's is unpublished, and FineWeb was made with datatrove's English splitter of 2024, NLTK's
punkt (a data download); datatrove moved English to spaCy in December 2024.

C4 edits text, as published: it drops lines (no terminal punctuation, fewer than 3 words, a word
over 1000 characters, 'javascript', cookie and terms-of-use lines; Wikipedia citation marks are
cut) and removes the document when too few sentences are left, or any kept line has 'lorem
ipsum' or a curly bracket. So ``Filters.check`` returns the text to keep, not just yes or no;
filters after c4 see its edited text. ``{"name": "c4", "filter_no_terminal_punct": false}`` is
C4 as FineWeb ran it.

    filters = make_filters(["gopher_quality", {"name": "c4", "min_num_sentences": 3}])
    verdict = filters.check(text)   # Verdict(text=kept text or None, removed_by=..., reason=...)

A Filters pickles as its spec; each process builds datatrove's filters on its first check.
"""

from __future__ import annotations

import functools
import importlib.metadata
import unicodedata
from typing import NamedTuple

import regex

from stoker.failures import ConfigError

FIELD = "data.filters"
WORDS_VERSION = 1  # of the splitter below: a change may change decisions, so it is in Filters.spec

# each filter's parameters and their published defaults (datatrove 0.10.1's); None turns a
# gopher rule off, -1 a c4 one. Lists are tuples here and lists in a spec.
FILTERS: dict[str, dict[str, object]] = {
    "gopher_quality": {
        "min_doc_words": 50,
        "max_doc_words": 100000,
        "min_avg_word_length": 3,
        "max_avg_word_length": 10,
        "max_symbol_word_ratio": 0.1,  # of '#', and of '...' or '…', to words
        "max_bullet_lines_ratio": 0.9,  # lines starting with '•' or '-'
        "max_ellipsis_lines_ratio": 0.3,
        "max_non_alpha_words_ratio": 0.8,  # (sic: the least share of words with a letter)
        "min_stop_words": 2,
        "stop_words": ("the", "be", "to", "of", "and", "that", "have", "with"),
    },
    "gopher_repetition": {
        "dup_line_frac": 0.3,
        "dup_para_frac": 0.3,
        "dup_line_char_frac": 0.2,
        "dup_para_char_frac": 0.2,
        "top_n_grams": ((2, 0.2), (3, 0.18), (4, 0.16)),
        "dup_n_grams": ((5, 0.15), (6, 0.14), (7, 0.13), (8, 0.12), (9, 0.11), (10, 0.10)),
    },
    "c4": {
        "split_paragraph": True,  # lines are lines (False: sentences)
        "remove_citations": True,
        "filter_no_terminal_punct": True,
        "min_num_sentences": 5,
        "min_words_per_line": 3,
        "max_word_length": 1000,
        "filter_lorem_ipsum": True,
        "filter_javascript": True,
        "filter_curly_bracket": True,
        "filter_policy": True,
    },
    "fineweb_quality": {
        "line_punct_thr": 0.12,
        "line_punct_exclude_zero": False,
        "stop_chars": None,  # the characters a line must end with; None: datatrove's terminal punctuation
        "short_line_thr": 0.67,
        "short_line_length": 30,
        "char_duplicates_ratio": 0.01,
        "new_line_ratio": 0.3,
    },
}
_CLASSES = {
    "gopher_quality": "gopher_quality_filter.GopherQualityFilter",
    "gopher_repetition": "gopher_repetition_filter.GopherRepetitionFilter",
    "c4": "c4_filters.C4QualityFilter",
    "fineweb_quality": "fineweb_quality_filter.FineWebQualityFilter",
}
_NULLABLE = set(FILTERS["gopher_quality"]) | set(FILTERS["gopher_repetition"]) | {"stop_chars"}


class Verdict(NamedTuple):
    """What the filters made of one document."""

    text: str | None  # the text to keep (c4 may have dropped lines); None: removed
    removed_by: str | None = None  # the first filter that removed it
    reason: str | None = None  # why, e.g. "fewer than 50 words (gopher_short_doc)": datatrove's code in brackets


# ---- the spec --------------------------------------------------------------------------
def make_filters(spec: list[str | dict] | None) -> Filters:
    """The filters of a spec: names, or {"name": ..., **params} to change published defaults.
    Raises one ConfigError listing every problem (unknown name or parameter, bad value)."""
    problems, resolved = [], []
    for i, entry in enumerate(spec or []):
        where = f"{FIELD}[{i}]"
        name = entry.get("name") if isinstance(entry, dict) else entry
        if isinstance(entry, dict) and "name" not in entry:
            problems.append(f"{where}: {entry!r} has no 'name'; give one of {', '.join(FILTERS)}.")
            continue
        if not isinstance(name, str) or name not in FILTERS:
            problems.append(
                f"{where}: {name!r} is not a filter; use one of {', '.join(FILTERS)} (a name, or a mapping with 'name' and parameters)."
            )
            continue
        if name in (n for n, _ in resolved):
            problems.append(f"{where}: {name!r} is listed twice; list each filter once.")
            continue
        params = dict(FILTERS[name])
        for key, value in entry.items() if isinstance(entry, dict) else ():
            if key == "name":
                continue
            if key not in params:
                problems.append(
                    f"{where} ({name}): {key!r} is not one of its parameters; use {', '.join(FILTERS[name])}."
                )
            elif (problem := _bad_value(key, value, FILTERS[name][key])) is not None:
                problems.append(f"{where} ({name}): {key}={value!r} {problem}.")
            else:
                params[key] = tuple(map(tuple, value)) if key.endswith("_n_grams") else _frozen(value)
        resolved.append((name, params))
    if problems:
        raise ConfigError(problems)
    return Filters(tuple(resolved))


def _frozen(value):
    return tuple(value) if isinstance(value, list) else value


def _bad_value(key: str, value, default) -> str | None:
    """What is wrong with a parameter's value (None: nothing), judged by its default's type."""
    if value is None:
        return None if key in _NULLABLE else "cannot be null; give a value"
    if isinstance(default, bool):
        return None if isinstance(value, bool) else "should be true or false"
    if isinstance(default, int):
        return None if isinstance(value, int) and not isinstance(value, bool) else "should be a whole number"
    if isinstance(default, float):
        return None if isinstance(value, (int, float)) and not isinstance(value, bool) else "should be a number"
    if key.endswith("_n_grams"):
        pairs = isinstance(value, (list, tuple)) and all(
            isinstance(p, (list, tuple))
            and len(p) == 2
            and type(p[0]) is int
            and p[0] >= 1
            and type(p[1]) in (int, float)
            for p in value
        )
        return None if pairs else "should be a list of [n, fraction] pairs, e.g. [[2, 0.2], [3, 0.18]]"
    ok = isinstance(value, (list, tuple)) and all(isinstance(s, str) and s for s in value)
    return None if ok else "should be a list of strings"


# ---- the filters -----------------------------------------------------------------------
class Filters:
    """Filters in their listed order; ``check`` is the call per document (pure: the same text
    and spec always give the same Verdict)."""

    def __init__(self, resolved: tuple[tuple[str, dict], ...]):
        self._resolved = resolved
        self._steps = None  # datatrove's filters, built in each process on its first check

    def __reduce__(self):  # a worker gets the spec, not datatrove's objects
        return type(self), (self._resolved,)

    def __len__(self) -> int:
        return len(self._resolved)

    def __repr__(self) -> str:
        return f"make_filters({self.spec!r})"

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self._resolved]

    @property
    def spec(self) -> list[dict]:
        """Every filter with all its parameters, as JSON: what a cache key of the decisions holds
        (with ``implementation``)."""
        return [{"name": n, **{k: _json(v) for k, v in p.items()}} for n, p in self._resolved]

    @property
    def implementation(self) -> str:
        """The code that decides (its version changes decisions): datatrove's and the splitter's."""
        return f"datatrove=={importlib.metadata.version('datatrove')} words=v{WORDS_VERSION}"

    def check(self, text: str) -> Verdict:
        """Verdict(text to keep, None, None), or Verdict(None, the first filter that removed the
        document, why)."""
        if not self._resolved:
            return Verdict(text)
        if self._steps is None:
            self._build()
        for name, params, step in self._steps:
            doc = _Document(text=text, id="")
            try:
                result = step.filter(doc)
            except ZeroDivisionError:  # datatrove divides by the number of words; this text has none
                return Verdict(None, name, "no words")
            if result is not True:
                code = result[1] if isinstance(result, tuple) else "removed"
                return Verdict(None, name, f"{_why(code, params)} ({code})")
            text = doc.text  # c4 dropped lines
        return Verdict(text, None, None)

    def _build(self) -> None:
        import importlib

        global _Document
        from datatrove.data import Document as _Document

        steps = []
        for name, params in self._resolved:
            module, cls = _CLASSES[name].rsplit(".", 1)
            step_cls = getattr(importlib.import_module(f"datatrove.pipeline.filters.{module}"), cls)
            step = step_cls(**params, language=_words())
            step.stat_update = _no_stats  # its counters are datatrove's pipeline's; each line counted costs time here
            steps.append((name, params, step))
        self._steps = steps


_Document = None  # datatrove.data.Document, imported with the first filters built


def _no_stats(*labels, value: int = 1, unit: str | None = None) -> None:
    pass


def _json(value):
    return [_json(v) for v in value] if isinstance(value, tuple) else value


# datatrove's drop codes in words, with the parameters that decide them ({pct[...]}: as a percentage)
_WHY = {
    "gopher_short_doc": "fewer than {min_doc_words} words",
    "gopher_long_doc": "more than {max_doc_words} words",
    "gopher_below_avg_threshold": "mean word length under {min_avg_word_length}",
    "gopher_above_avg_threshold": "mean word length over {max_avg_word_length}",
    "gopher_too_many_hashes": "more than {max_symbol_word_ratio} '#' per word",
    "gopher_too_many_ellipsis": "more than {max_symbol_word_ratio} ellipses per word",
    "gopher_too_many_bullets": "over {pct[max_bullet_lines_ratio]} of lines start with a bullet",
    "gopher_too_many_end_ellipsis": "over {pct[max_ellipsis_lines_ratio]} of lines end with an ellipsis",
    "gopher_below_alpha_threshold": "under {pct[max_non_alpha_words_ratio]} of words have a letter",
    "gopher_enough_stop_words": "fewer than {min_stop_words} of the stop words",
    "dup_para_frac": "over {pct[dup_para_frac]} of paragraphs are repeats",
    "dup_para_char_frac": "repeated paragraphs hold over {pct[dup_para_char_frac]} of the characters",
    "dup_line_frac": "over {pct[dup_line_frac]} of lines are repeats",
    "dup_line_char_frac": "repeated lines hold over {pct[dup_line_char_frac]} of the characters",
    "top_n_gram": "the commonest {n}-gram covers over {pct[n_gram]} of the characters",
    "duplicated_n_grams": "repeated {n}-grams cover over {pct[n_gram]} of the characters",
    "lorem_ipsum": "a kept line has 'lorem ipsum'",
    "curly_bracket": "a kept line has a curly bracket",
    "too_few_sentences": "fewer than {min_num_sentences} sentences in the lines kept",
    "line_punct_ratio": "under {pct[line_punct_thr]} of lines end in terminal punctuation",
    "short_line_ratio": "over {pct[short_line_thr]} of lines have at most {short_line_length} characters",
    "char_dup_ratio": "repeated lines hold over {pct[char_duplicates_ratio]} of the characters",
    "list_ratio": "more than {new_line_ratio} line breaks per word",
    "empty": "no text",
}


def _why(code: str, params: dict) -> str:
    """A datatrove drop code in words (an unknown one as it is)."""
    p = dict(params)
    if code.startswith(("top_", "duplicated_")):  # top_2_gram, duplicated_5_n_grams
        kind, n, _ = code.split("_", 2)
        p["n"], p["n_gram"] = n, dict(params["top_n_grams" if kind == "top" else "dup_n_grams"])[int(n)]
        code = "top_n_gram" if kind == "top" else "duplicated_n_grams"
    pct = {k: f"{v * 100:g}%" for k, v in p.items() if type(v) in (int, float)}
    return _WHY[code].format(pct=pct, **p) if code in _WHY else code


# ---- the word splitter -----------------------------------------------------------------
# spaCy's English tokenizer rules (spacy/lang/punctuation.py, lang/en/tokenizer_exceptions.py)
# where they move these filters' counts, in order of precedence; any other character alone.
_ABBREVIATIONS = (
    "Mr Mrs Ms Dr Prof St Jr Sr Inc Ltd Co Corp vs Mt Gen Sen Rep Gov Jan Feb Mar Apr Jun Jul Aug Sep Sept Oct Nov Dec"
)
_CONTRACTION = r"(?:['’](?:s|S|re|ve|ll|d|m)|n['’]t)(?!\w)"
WORD = regex.compile(
    "|".join(
        (
            r"(?:https?://|www\.)[^\s<>\"']+[^\s<>\"'.,;:!?)\]}]",  # a URL, whole
            r"(?:%s)\." % "|".join(_ABBREVIATIONS.split()),  # Mr.
            r"\p{L}\.(?!\w)",  # an initial, a list item: J. a.
            r"(?i:can)(?=not\b)|(?<=(?i:can))not\b",  # can|not
            # the common case first, for speed: letters that end where spaCy ends a word
            r"\p{L}+(?=[\s,;:!?()\[\]{}\"“”]|\.(?!\w)|['’](?:(?:s|S|re|ve|ll|d|m)(?!\w)|(?!\w))|$)",
            r"(?:\p{L}\.){2,}",  # e.g. U.S.A.
            r"and/or",
            r"[\w.+-]++@[\w-]+(?:\.[\w-]+)+",  # an e-mail address
            r"\d+(?:[.,:/]\d+)+",  # 3.5 1,000 10:30 24/7
            r"\w+(?:['’]\w+)*?(?=%s)" % _CONTRACTION,  # do|n't, it|'s, they|'re
            _CONTRACTION,
            r"\p{L}\w*(?:-\d\w*(?:\.\d+)*)+",  # COVID-19, Apache-2.0 (a hyphen between letters, or digits, splits)
            r"(?:(?<!\S)\.)?\w+(?:['’]\w+)*(?:\.(?!\p{Lu})\w+)*",  # words: O'Brien, file.txt, v2.0, .pdbrc
            r"\.\.+|--+|''|[:;]-?[()]",  # ... -- '' :)
            r"\S",
        )
    )
)


def words(text: str) -> list[str]:
    """The words of a text, as the filters count them (punctuation marks are words of their own)."""
    return WORD.findall(text)


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of each sentence: spaCy's sentencizer rule over ``words``, a sentence ends at
    a terminal punctuation mark, once a word that is not punctuation follows."""
    terminal = _terminal_punctuation()
    spans, start, end, seen_end = [], None, 0, False
    for m in WORD.finditer(text):
        word = m.group()
        if start is None:
            start = m.start()
        elif seen_end and not _is_punct(word):
            spans.append((start, end))
            start, seen_end = m.start(), False
        if word in terminal:
            seen_end = True
        end = m.end()
    if start is not None:
        spans.append((start, end))
    return spans


@functools.cache
def _terminal_punctuation() -> set[str]:  # spaCy's sentencizer's punct_chars, as datatrove lists them
    from datatrove.utils.text import TERMINAL_PUNCTUATION

    return TERMINAL_PUNCTUATION


def _is_punct(word: str) -> bool:  # spaCy's is_punct
    return all(unicodedata.category(c).startswith("P") for c in word)


@functools.cache
def _words():
    """The splitter as datatrove takes it (a WordTokenizer passed as `language`): one per process,
    as datatrove's caches keep every tokenizer they see."""
    from datatrove.utils.word_tokenizers import WordTokenizer

    class Words(WordTokenizer):
        def word_tokenize(self, text: str) -> list[str]:
            return words(text)

        def sent_tokenize(self, text: str) -> list[str]:
            return [text[a:b] for a, b in sentence_spans(text)]

        def span_tokenize(self, text: str) -> list[tuple[int, int]]:
            return sentence_spans(text)

    return Words("en")
