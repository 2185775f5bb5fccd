"""eval.sets and eval.multiple_choice_items: what a checkpoint's evaluation measures, checked
before anything runs (the check `stoker run` and `stoker validate` make), and no part of the
run's identity."""

import pytest

from stoker.cli import checked_config
from stoker.config import ConfigError, load_config


def test_unknown_evaluation_sets_are_refused_naming_the_field_and_the_choices():
    with pytest.raises(ConfigError) as err:
        checked_config("tiny-cpu", ["eval.sets=[loss, hellaswag, bpb, mmlu]"])
    [line] = err.value.problems
    assert line.startswith("eval.sets: 'hellaswag', 'mmlu': not an evaluation set")
    assert "'loss', 'bpb' and 'multiple_choice'" in line


def test_the_sets_must_keep_the_loss_and_the_item_count_fits_the_set():
    with pytest.raises(ConfigError) as err:
        load_config("tiny-cpu", **{"eval.sets": ["bpb"], "eval.multiple_choice_items": 501})
    assert [p.split(":")[0] for p in err.value.problems] == ["eval.sets", "eval.multiple_choice_items"]
    assert "add 'loss' to the list" in err.value.problems[0]


def test_the_default_measures_every_set_and_a_run_keeps_its_identity_whatever_it_measures():
    default = load_config("tiny-cpu")
    assert default.eval.sets == ["loss", "bpb", "multiple_choice"] and default.eval.multiple_choice_items == 100
    fewer = load_config("tiny-cpu", **{"eval.sets": "loss", "eval.multiple_choice_items": 7})
    assert fewer.eval.sets == ["loss"]
    assert fewer.identity_hash() == default.identity_hash()
    assert load_config("tiny-cpu", **{"eval.sets": ["loss", "bpb", "loss"]}).eval.sets == ["loss", "bpb"]
