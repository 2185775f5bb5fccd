"""The learning rate made for a base (stoker.arithmetic.learning_rate): the width-to-peak rule
against the published peaks it is calibrated on, its bounds, and the stated fraction, which gives
the project's own recipes for a base their rates. Pure arithmetic: no torch, no files but the
recipes."""

import math

import pytest
import yaml

from stoker.arithmetic import plan as plans
from stoker.arithmetic.learning_rate import (
    CALIBRATION,
    FRACTION,
    MAX_PEAK,
    continued_pretraining_lr,
    peak_lr,
)
from stoker.config import RECIPES_DIR, load_config


def test_the_rule_is_within_a_factor_of_2_4_of_every_published_peak_and_unbiased_over_them():
    ratios = {name: peak_lr(width) / published for name, width, published, _ in CALIBRATION}
    far = {name: round(r, 2) for name, r in ratios.items() if not 1 / 2.4 <= r <= 2.4}
    assert not far, far
    mean = math.exp(sum(math.log(r) for r in ratios.values()) / len(ratios))
    assert 0.85 < mean < 1.15, mean
    # anchored on Llama 3: exact at 8B and 70B, within 7% at 405B
    assert ratios["Llama 3 8B"] == pytest.approx(1.0) and ratios["Llama 3 70B"] == pytest.approx(1.0)
    assert ratios["Llama 3 405B"] == pytest.approx(1.0, rel=0.07)
    assert {source.split(",")[0] for *_, source in CALIBRATION} == {
        "Allal et al. 2025",
        "Bai et al. 2023",
        "Llama Team 2024",
    }


def test_a_narrow_base_gets_no_more_than_the_highest_published_peak_and_a_wider_one_less():
    assert MAX_PEAK == max(published for _, _, published, _ in CALIBRATION)
    assert peak_lr(64) == peak_lr(96) == MAX_PEAK  # the tiny bases of the tests
    widths = [2**k for k in range(4, 16)] + [576, 896, 960, 1536, 2560, 3584, 5120]
    peaks = [peak_lr(w) for w in sorted(widths)]
    assert all(a >= b for a, b in zip(peaks, peaks[1:])) and peaks[-1] < peaks[0]
    assert peak_lr(576) == pytest.approx(1.2288 / 576)  # SmolLM2-135M's width: 2.13e-3
    with pytest.raises(ValueError, match="positive number"):
        peak_lr(0)


@pytest.mark.parametrize("recipe", ["llama-3.1-8b", "llama-3.1-70b"])
def test_a_tenth_of_the_peak_is_the_rate_the_projects_recipes_give_their_base(recipe):
    """The recipes for a Llama base say 'about a tenth of the base's peak': the default is theirs."""
    cfg = load_config(recipe)
    assert FRACTION == 0.1
    assert continued_pretraining_lr(cfg.model.n_embd) == pytest.approx(cfg.train.lr)
    assert continued_pretraining_lr(cfg.model.n_embd) == pytest.approx(FRACTION * peak_lr(cfg.model.n_embd))


def test_the_plan_of_a_base_not_read_in_says_the_rate_its_ranks_will_train_at():
    """A config that writes the base's architecture (its width known) and no rate: the plan says
    the base's rate, with its origin, though train.lr is only set when the base is read."""
    data = yaml.safe_load((RECIPES_DIR / "llama-3.2-1b.yaml").read_text())
    for name in ("lr", "min_lr"):
        del data["train"][name]
    cfg = load_config(data)  # its own config, not the recipe: every field in it is the user's
    p = plans.plan(cfg)
    assert cfg.train.lr_from_base is True and cfg.model.n_embd == 2048
    assert p.schedule.startswith("warm-up 200 steps from 0 to 6e-05, stable 6e-05 to step 8000, then a linear decay")
    assert p.lr_origin.startswith(
        "the base (no train.lr written): 6e-05 = 0.1 x 0.0006, the peak learning rate of a base 2048 wide"
    )
    assert ("learning rate from", p.lr_origin) in p.rows()
