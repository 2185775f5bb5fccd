"""The learning rate of a run from a base (continued pretraining) whose config writes none: a
stated fraction of the peak learning rate a base of that width was pretrained at.

The peak scales as one over the base's hidden size (its width: the 1/fan-in rule of μP for
Adam's hidden layers, Yang et al. 2022, "Tensor Programs V", arXiv:2203.03466), with the constant
of Llama 3 8B (3e-4 at 4096, which is also Llama 3 70B's 1.5e-4 at 8192), and never above 3e-3,
the highest peak published for these bases (SmolLM2's small models):

    peak(width) = min(3e-3, 1.2288 / width)        lr = 0.1 x peak(width)

Calibration, the published peak learning rates of pretrained bases (``CALIBRATION``; the
rule's value beside each):

=============  ======  ==========  =========  ===========================================
base           width   published   the rule   source
=============  ======  ==========  =========  ===========================================
SmolLM2-135M     576     3e-3       2.13e-3   Allal et al. 2025, "SmolLM2: When Smol Goes
SmolLM2-360M     960     3e-3       1.28e-3   Big", arXiv:2502.02737 (training setups)
SmolLM2-1.7B    2048     5e-4       6.0e-4
Qwen-1.8B       2048     3e-4       6.0e-4    Bai et al. 2023, "Qwen Technical Report",
Qwen-7B         4096     3e-4       3.0e-4    arXiv:2309.16609, Table 1
Qwen-14B        5120     3e-4       2.4e-4
Llama 3 8B      4096     3e-4       3.0e-4    Llama Team 2024, "The Llama 3 Herd of
Llama 3 70B     8192     1.5e-4     1.5e-4    Models", arXiv:2407.21783, Table 3
Llama 3 405B   16384     8e-5       7.5e-5
=============  ======  ==========  =========  ===========================================

Every point is within a factor of 2.4 of the rule (the farthest: SmolLM2-360M, trained hotter,
and Qwen-1.8B, cooler), and the rule is unbiased over the table (the geometric mean of
rule / published is 0.94). Qwen2.5 and Qwen3 publish no per-model peak: their reports set it by
a scaling law of hyper-parameters whose numbers they do not give, so their bases take the rate
of their width (Qwen2.5-0.5B, 896 wide: peak 1.37e-3, lr 1.37e-4; Qwen3-8B, 4096: 3e-4, 3e-5).

The fraction: continued pretraining re-warms to about a tenth of the base's peak, as every
recipe of this project written for a base does (``stoker/recipes/llama-3.1-8b.yaml``: 3e-5 for
Llama-3.1-8B, "about a tenth of the base's peak"; 70B: 1.5e-5), trading some of the adaptation
of re-warming to the full peak for much less forgetting of what the base knows (Ibrahim et al.
2024, "Simple and Scalable Strategies to Continually Pre-train Large Language Models",
arXiv:2403.08763). With this fraction the rule gives those recipes' own rates.

Which config gets it is decided when the config is loaded (``config.run.base_lr_default``,
``train.lr_from_base``); the number is set when the base is read (``with_base_lr``, from
``storage.bases.resolve_base``) and said before launch with where it came from (``origin``, in
the plan and so in the run's log).
"""

from __future__ import annotations

from typing import Any

# (base, hidden size, published peak learning rate, source)
CALIBRATION: tuple[tuple[str, int, float, str], ...] = (
    ("SmolLM2-135M", 576, 3e-3, "Allal et al. 2025, arXiv:2502.02737"),
    ("SmolLM2-360M", 960, 3e-3, "Allal et al. 2025, arXiv:2502.02737"),
    ("SmolLM2-1.7B", 2048, 5e-4, "Allal et al. 2025, arXiv:2502.02737"),
    ("Qwen-1.8B", 2048, 3e-4, "Bai et al. 2023, arXiv:2309.16609, Table 1"),
    ("Qwen-7B", 4096, 3e-4, "Bai et al. 2023, arXiv:2309.16609, Table 1"),
    ("Qwen-14B", 5120, 3e-4, "Bai et al. 2023, arXiv:2309.16609, Table 1"),
    ("Llama 3 8B", 4096, 3e-4, "Llama Team 2024, arXiv:2407.21783, Table 3"),
    ("Llama 3 70B", 8192, 1.5e-4, "Llama Team 2024, arXiv:2407.21783, Table 3"),
    ("Llama 3 405B", 16384, 8e-5, "Llama Team 2024, arXiv:2407.21783, Table 3"),
)
PEAK_TIMES_WIDTH = 3e-4 * 4096  # 1.2288: Llama 3 8B's peak x its width (70B's too: 1.5e-4 x 8192)
MAX_PEAK = 3e-3  # the highest published peak (SmolLM2-135M and -360M): a narrow base gets no more
FRACTION = 0.1  # continued pretraining re-warms to about a tenth of the base's peak


def peak_lr(width: int) -> float:
    """The peak learning rate a base `width` wide was pretrained at, by the rule above."""
    if width < 1:
        raise ValueError(f"a base's width is a positive number of features, not {width}")
    return min(MAX_PEAK, PEAK_TIMES_WIDTH / width)


def continued_pretraining_lr(width: int) -> float:
    """train.lr of a run from a base `width` wide whose config writes none: FRACTION of its peak."""
    return FRACTION * peak_lr(width)


def width_of(model: Any) -> int | None:
    """A model section's hidden size (the family's plan shape says it), or None while the base
    that fixes it is not read in."""
    if model.unresolved():
        return None
    return int(model.plan_shape(1)["width"])


def base_lr(cfg: Any) -> float | None:
    """The learning rate `cfg` trains at by the default for its base (train.lr_from_base), or
    None: a rate the config writes, or a base whose width is not known yet."""
    if not getattr(cfg.train, "lr_from_base", None) or not getattr(cfg.model, "init_from", None):
        return None
    width = width_of(cfg.model)
    return None if width is None else continued_pretraining_lr(width)


def with_base_lr(cfg: Any) -> Any:
    """`cfg` with train.lr the default for its base where it takes it (validated again: a
    min_lr the user wrote above that rate is told as the config's problem); `cfg` otherwise."""
    lr = base_lr(cfg)
    if lr is None or lr == cfg.train.lr:
        return cfg
    data = cfg.model_dump()
    data["train"]["lr"] = lr
    return type(cfg).model_validate(data)


def effective_train(cfg: Any) -> Any:
    """The train section the ranks will run: the config's, with the base's default rate where it
    takes it and the base's width is known (before the base is read in, for the plan)."""
    lr = base_lr(cfg)
    return cfg.train if lr is None else cfg.train.model_copy(update={"lr": lr})


def origin(cfg: Any) -> str:
    """Where train.lr comes from, in a line (the plan, the run's log): '' without a base."""
    if not getattr(cfg.model, "init_from", None):
        return ""
    width = width_of(cfg.model)
    if width is None:
        return "the base's default, once its width is read"
    peak, lr = peak_lr(width), continued_pretraining_lr(width)
    made = (
        f"{lr:.3g} = {FRACTION:g} x {peak:.3g}, the peak learning rate of a base {width} wide "
        f"(min({MAX_PEAK:g}, {PEAK_TIMES_WIDTH:g} / {width}), calibrated on the published peaks of Llama 3, "
        "Qwen and SmolLM2: stoker.arithmetic.learning_rate)"
    )
    if getattr(cfg.train, "lr_from_base", None):
        return f"the base (no train.lr written): {made}; write train.lr to choose another"
    return f"train.lr as the config writes it (the base's default would be {made})"
