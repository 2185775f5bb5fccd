"""Gain and forgetting since the base (stoker.arithmetic.gains) on hand-made evaluation records of
two sources. Every value is a binary fraction (3.5, 0.125 ...), so each change is exact and the
expected numbers are written out as literals, not computed by a subtraction like the code's.
Each test carries a control: the same assertion on a deliberately wrong input (base and trained
swapped, one source's values given to the other) does not hold."""

from __future__ import annotations

from stoker.arithmetic.gains import changes_since_base, eval_values, since_base_text
from stoker.contracts.events import Eval, Train


def _eval(step: int, losses: dict | None = None, bpbs: dict | None = None, **one_source) -> dict:
    """An in-loop evaluation record as metrics.jsonl holds it (events.Eval.to_dict): a mixture's
    per-source values (val_loss their mean), or one source's val_loss and bits_per_byte."""
    if losses is not None:
        one_source.setdefault("val_loss", sum(losses.values()) / len(losses))
    return Eval(step=step, val_ppl=1.0, sources=losses, sources_bpb=bpbs, time=1000.0 + step, **one_source).to_dict()


# the base (step 0): domain 3.5 nats / 1.5 bpb, general 2.25 nats / 1.0 bpb
TWO_SOURCES = [
    _eval(0, {"domain": 3.5, "general": 2.25}, {"domain": 1.5, "general": 1.0}),
    Train(step=2, loss=9.0, lr=1e-3, step_seconds=1.0, tokens_seen=64).to_dict(),  # not an evaluation
    _eval(4, {"domain": 9.0, "general": 9.0}, {"domain": 9.0, "general": 9.0}),  # redone after a resume:
    _eval(4, {"domain": 3.0, "general": 2.375}, {"domain": 1.25, "general": 1.0625}),  # this one counts
    _eval(6, {"domain": 2.875}, {}),  # general not measured here, no bits per byte
    _eval(8, {"domain": 2.75, "general": 2.5, "code": 1.0}, {"domain": 1.125, "general": 1.125}),
]
DOMAIN_LOSS = [(0, 0.0), (4, -0.5), (6, -0.625), (8, -0.75)]
GENERAL_LOSS = [(0, 0.0), (4, 0.125), (8, 0.25)]
DOMAIN_BPB = [(0, 0.0), (4, -0.25), (8, -0.375)]
GENERAL_BPB = [(0, 0.0), (4, 0.0625), (8, 0.125)]


def test_changes_since_base_are_each_sources_loss_and_bpb_minus_the_step_zero_evaluation():
    changes = changes_since_base(TWO_SOURCES)
    assert list(changes) == ["domain", "general"]  # 'code', absent at the base, has no change
    domain, general = changes["domain"], changes["general"]
    assert (domain["base_loss"], domain["base_bpb"], general["base_loss"], general["base_bpb"]) == (3.5, 1.5, 2.25, 1.0)
    assert domain["loss"] == DOMAIN_LOSS and domain["bpb"] == DOMAIN_BPB
    assert general["loss"] == GENERAL_LOSS and general["bpb"] == GENERAL_BPB  # no step 6: not measured
    assert since_base_text(changes) == (
        "domain -0.75 nats (-0.375 bpb), general +0.25 nats (+0.125 bpb) since the base (step 8)"
    )

    # control: base and trained swapped (the step-8 values at step 0 and back) flips every sign
    swapped = [dict(r) for r in TWO_SOURCES if r["event"] == "eval" and r["step"] in (0, 8)]
    swapped[0]["step"], swapped[1]["step"] = 8, 0
    wrong = changes_since_base(swapped)
    assert wrong["domain"]["loss"][-1] == (8, 0.75) != DOMAIN_LOSS[-1]
    assert wrong["general"]["bpb"][-1] == (8, -0.125) != GENERAL_BPB[-1]
    # control: the domain's values given to the general source (and back) do not give its change
    crossed = [
        {**r, "sources": {"domain": r["sources"].get("general"), "general": r["sources"]["domain"]}}
        for r in TWO_SOURCES
        if r["event"] == "eval" and r["step"] in (0, 4, 8)
    ]
    assert changes_since_base(crossed)["general"]["loss"] != GENERAL_LOSS


def test_without_a_step_zero_evaluation_there_is_no_change_to_tell():
    """A run from scratch, or a branch before its lineage's base record is added (observe.report
    records_with_the_base): no base, so {} and no line, not changes against the first record."""
    later = [r for r in TWO_SOURCES if r.get("step") != 0]
    assert changes_since_base(later) == {} and since_base_text({}) == ""
    # control: with the base record the same records do have changes
    assert changes_since_base(TWO_SOURCES) != {}
    # a step-0 record without a validation loss is no base either
    assert changes_since_base([{**TWO_SOURCES[0], "val_loss": None}, *later]) == {}


def test_one_source_is_named_main_and_its_bits_per_byte_come_from_the_mean_fields():
    records = [
        _eval(0, val_loss=3.0, bits_per_byte=1.25),
        _eval(5, val_loss=2.5, bits_per_byte=1.0),
        _eval(10, val_loss=2.75, bits_per_byte=None),  # bpb not measured at the last evaluation
    ]
    changes = changes_since_base(records)
    assert changes == {
        "main": {
            "loss": [(0, 0.0), (5, -0.5), (10, -0.25)],
            "bpb": [(0, 0.0), (5, -0.25)],
            "base_loss": 3.0,
            "base_bpb": 1.25,
        }
    }
    # the last loss is at step 10, its bits per byte are not: no '(... bpb)' for another step's
    assert since_base_text(changes) == "main -0.25 nats since the base (step 10)"
    # control: with the step-10 bits per byte the line does tell them
    measured = [*records[:2], _eval(10, val_loss=2.75, bits_per_byte=1.125)]
    assert since_base_text(changes_since_base(measured)) == "main -0.25 nats (-0.125 bpb) since the base (step 10)"


def test_a_mixtures_mean_bits_per_byte_is_no_sources_and_a_base_without_bpb_tells_none():
    # a mixture with only the mean bits per byte: it is not any one source's
    assert eval_values(_eval(0, {"a": 2.0, "b": 3.0}, None, bits_per_byte=1.5)) == ({"a": 2.0, "b": 3.0}, {})
    # control: one source's mean bits per byte is its own
    assert eval_values(_eval(0, val_loss=2.0, bits_per_byte=1.5)) == ({"main": 2.0}, {"main": 1.5})
    # an events.Eval object reads as its dict does
    record = Eval(step=0, val_loss=2.0, val_ppl=7.39, sources={"a": 1.5, "b": 2.5}, sources_bpb={"a": 0.5})
    assert eval_values(record) == ({"a": 1.5, "b": 2.5}, {"a": 0.5})

    # the base measured no bits per byte for b: b's bpb change stays empty though step 4 has one
    changes = changes_since_base(
        [_eval(0, {"a": 2.0, "b": 3.0}, {"a": 1.0}), _eval(4, {"a": 1.5, "b": 3.5}, {"a": 0.75, "b": 2.0})]
    )
    assert changes["a"]["bpb"] == [(0, 0.0), (4, -0.25)] and changes["b"]["bpb"] == []
    assert changes["b"]["base_bpb"] is None and changes["b"]["loss"] == [(0, 0.0), (4, 0.5)]
    assert since_base_text(changes) == "a -0.50 nats (-0.250 bpb), b +0.50 nats since the base (step 4)"


def test_a_line_waits_for_an_evaluation_after_the_base():
    """Only the step-0 evaluation so far (the flow's log at the run's start): no line; a source
    last measured at an earlier step than another's keeps its own last change."""
    assert since_base_text(changes_since_base(TWO_SOURCES[:1])) == ""
    # control: one later evaluation and there is a line
    assert since_base_text(changes_since_base(TWO_SOURCES[:4])) != ""
    changes = changes_since_base([*TWO_SOURCES[:5]])  # domain last at step 6, general at step 4
    assert since_base_text(changes) == "domain -0.62 nats, general +0.12 nats (+0.062 bpb) since the base (step 6)"
