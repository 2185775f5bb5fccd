"""The checkpoint table and the report show each evaluation's bits per byte and
multiple-choice accuracy next to its validation loss, where they were measured."""

from stoker.contracts.results import EvalResult, TrainingResult
from stoker.observe.report import checkpoint_rows, evaluation_line, rounded


def _eval(uri, **extra):
    return EvalResult(checkpoint_uri=uri, step=4, val_loss=2.5, val_ppl=12.18, windows=8, seconds=1.0, **extra)


def test_checkpoint_rows_carry_bits_per_byte_and_multiple_choice_accuracy():
    training = TrainingResult(
        final_step=8,
        final_checkpoint_key=None,
        final_checkpoint_uri="file:///r/step-8",
        resumed_from_step=0,
        attempts=1,
        seconds=1.0,
        checkpoints=[{"step": 4, "uri": "file:///r/step-4"}, {"step": 8, "uri": "file:///r/step-8"}],
        evaluations=[_eval("file:///r/step-4")],  # measured the loss only
    )
    final = _eval(
        "file:///r/step-8", bits_per_byte=1.234567, mc_accuracy=0.31, mc_accuracy_norm=0.4123, num_mc_items=100
    )
    early, last = rounded(checkpoint_rows(training, final))
    assert (early["val_loss"], early["bits_per_byte"], early["mc_acc_norm"]) == (2.5, None, None)
    assert (last["bits_per_byte"], last["mc_acc_norm"]) == (1.2346, 0.412)
    assert evaluation_line(final) == (
        "validation loss 2.5000, perplexity 12.2, 1.2346 bits per byte, multiple choice 41.2% "
        "(acc_norm; acc 31.0%, 100 items, chance 25%)"
    )
    assert evaluation_line(training.evaluations[0]) == "validation loss 2.5000, perplexity 12.2"
