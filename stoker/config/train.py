"""The train section (``TrainConfig``): the optimizer, the batch, the steps and the learning
rate's schedule as fields, and the names of those fields the schedule reads (its arithmetic:
``stoker.arithmetic.schedule``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from stoker.fields import _field, _rule, _Section

# the fields of the train section the learning rate reads
SCHEDULE_FIELDS = (
    "lr_schedule",
    "lr",
    "min_lr",
    "warmup_steps",
    "warmup_from",
    "max_steps",
    "decay_steps",
    "decay_shape",
)
# those the stable part reads
PREFIX_FIELDS = ("lr_schedule", "lr", "warmup_steps", "warmup_from")
# a run whose past does not depend on its end: trained longer under the same name
EXTENSIBLE = ("wsd", "constant")
# what a 'wsd' or 'constant' run's identity leaves out: its end
END_FIELDS = ("max_steps", "decay_steps", "decay_shape", "min_lr")
# a re-warmed branch's (train.rewarm): where its schedule starts; hashed only when it is set, so
# every schedule written before it keeps its signature
REWARM_FIELDS = ("rewarm", "branch_step")


class TrainConfig(_Section):
    seed: int = Field(1337, description="Seed of the model init and of the data order.")
    max_steps: int = _field(500, "Optimizer steps to train in total (across resumes).", ge=1)
    global_batch_size: int = _field(
        16,
        "Sequences per optimizer step across all ranks.",
        fix="use a multiple of world_size x micro_batch_size",
        ge=1,
    )
    micro_batch_size: int | Literal["auto"] = _field(
        4,
        "Sequences per rank per forward pass; the rest is gradient accumulation. 'auto': the "
        "largest that fits the device by the run's plan (stoker plan), confirmed on a GPU by a "
        "probe step at start-up; the global batch, the data order and so the run stay the same "
        "as with that value set by hand. The value chosen is logged and in the run's result.",
        fix="give a number of sequences, e.g. 4, or 'auto'",
    )
    lr: float = _field(3e-3, "Peak learning rate of AdamW.", fix="a typical value is 3e-4", gt=0)
    lr_from_base: bool | None = Field(
        None,
        description="Set by stoker when the config is loaded, for a run from a base (model.init_from). "
        "true: the config writes no train.lr (a built-in recipe not written for this base gives its rate "
        "way), so train.lr is the continued-pretraining default, set when the base is read: a tenth of "
        "the peak a base of its width was pretrained at (min(3e-3, 1.2288 / hidden size), calibrated on "
        "Llama 3, Qwen and SmolLM2: stoker.arithmetic.learning_rate), and, where the config writes "
        "none, lr_schedule 'wsd' (a re-warm and hold, trained longer or annealed by a branch), "
        "decay_steps a fifth of max_steps and min_lr 0. false: train.lr as written. Empty: no base. "
        "The plan says which, with the number.",
        json_schema_extra={"fix": "leave it empty: write train.lr to choose the rate"},
    )
    min_lr: float = _field(
        3e-4, "Learning rate at the end of the decay (cosine, linear, wsd).", fix="e.g. a tenth of lr", ge=0
    )
    warmup_steps: int = _field(
        20, "Linear warm-up steps before the schedule.", fix="a few percent of max_steps is typical", ge=0
    )
    lr_schedule: Literal["cosine", "wsd", "constant", "linear"] = Field(
        "cosine",
        description="The learning rate over the run's steps, after the warm-up: 'cosine' (to min_lr "
        "at max_steps), 'linear' (likewise, in a line), 'wsd' (warmup-stable-decay: lr until the "
        "last decay_steps steps, then decay_shape down to min_lr at the last step) or 'constant' "
        "(lr). A 'wsd' or 'constant' run's past does not depend on its end: given a larger "
        "max_steps under the same name it goes on from its newest checkpoint before its decay (retention "
        "keeps it; a change that leaves none to go on from is refused).",
        json_schema_extra={"fix": "use 'cosine', 'wsd', 'constant' or 'linear'"},
    )
    decay_steps: int | None = _field(
        None,
        "'wsd': the steps of the final decay, at the end of the run (Hagele et al. 2024: about 20% "
        "of the steps matches cosine).",
        fix="e.g. a fifth of max_steps, below max_steps - warmup_steps",
        ge=1,
        validate_default=True,
    )
    decay_shape: Literal["linear", "sqrt", "cosine"] = Field(
        "linear",
        description="'wsd': the shape of the decay from lr to min_lr: 'linear', 'sqrt' (1 - sqrt of "
        "the progress) or 'cosine'.",
        json_schema_extra={"fix": "use 'linear', 'sqrt' or 'cosine'"},
    )
    warmup_from: float = _field(
        0.0,
        "Where the linear warm-up starts, as a fraction of lr (re-warming a base from the end of its "
        "own schedule: e.g. 0.1); 0: from (nearly) zero.",
        fix="a fraction in [0, 1], e.g. 0.1",
        ge=0,
        le=1,
    )
    branch_from: str | None = _field(
        None,
        "Start this run from a committed checkpoint of another run (its URI, as `stoker checkpoints "
        "RUN` lists it, under this run's storage.root): its weights, optimizer state, step and data "
        "position. This run's config may change the schedule (decay now), the learning rate, the "
        "mixture, the evaluation, the parallelism and the world size, not the model or tokenizer. "
        "The parent run is never written; the branch records its lineage.",
        fix="give a checkpoint URI from `stoker checkpoints RUN`, or leave it empty",
        min_length=1,
    )
    branch_sha256: str | None = _field(
        None,
        "Set by stoker from train.branch_from: the sha256 of that checkpoint's commit manifest, which "
        "pins the branch to it. Leave it empty.",
        fix="leave it empty: stoker computes it from train.branch_from",
        pattern=r"^[0-9a-f]{64}$",
    )
    rewarm: bool = _field(
        False,
        "A branch (train.branch_from) warms up again from its branch point: train.warmup_steps counted "
        "from there, from warmup_from x lr up to lr; a 'cosine' or 'linear' schedule then decays over the "
        "branch's own steps, from the end of that warm-up to min_lr at max_steps ('wsd' keeps its decay "
        "over the last decay_steps). Off: the branch keeps the whole run's timeline (its warm-up counted "
        "from step 0, so none after it; a 'cosine' or 'linear' branch takes the curve of steps 0 to "
        "max_steps at its own steps).",
        fix="true only with train.branch_from; warmup_steps then counts from the branch point",
    )
    branch_step: int | None = _field(
        None,
        "Set by stoker from train.branch_from: the step of that checkpoint, where a re-warmed branch's "
        "schedule starts (train.rewarm). Leave it empty.",
        fix="leave it empty: stoker reads it from train.branch_from's checkpoint",
        ge=0,
    )
    weight_decay: float = _field(0.1, "AdamW weight decay on 2-D weights.", fix="0.1 is typical", ge=0)
    beta1: float = _field(0.9, "AdamW beta1.", fix="0.9 is typical", ge=0, lt=1)
    beta2: float = _field(0.95, "AdamW beta2.", fix="0.95 is typical", ge=0, lt=1)
    grad_clip: float = _field(
        1.0, "Clip the global gradient norm to this (0 = off).", fix="0 turns clipping off; 1.0 is typical", ge=0
    )
    log_interval: int = _field(10, "Steps between training-loss log lines.", ge=1)
    deterministic: bool | Literal["auto"] = Field(
        "auto",
        description="Deterministic torch algorithms (and, past 2 ranks, DDP's gradient "
        "buckets fixed) so a run resumed at the same world size ends bitwise equal to one that "
        "never stopped. 'auto': on with CPU ranks (it costs almost nothing there), off on CUDA "
        "(it costs speed; a resumed GPU run is then equal up to rounding). true or false: "
        "always on or off.",
        json_schema_extra={"fix": "give true, false or 'auto'"},
    )
    nonfinite: Literal["fail", "skip"] = Field(
        "fail",
        description="What a step whose loss or gradient norm is NaN/inf does. 'fail': "
        "the run stops within one log interval (and before any checkpoint), naming the step, and "
        "is not retried. 'skip': the step's update is not applied (the step number, the data "
        "order and the learning-rate schedule go on), up to nonfinite_skip_limit skipped steps, "
        "then fail; skip reads one flag per step (a host sync the fail policy does not need).",
        json_schema_extra={"fix": "use 'fail' (the default) or 'skip'"},
    )
    nonfinite_skip_limit: int = _field(
        3,
        "Under nonfinite='skip': how many non-finite steps one launch may skip before it fails.",
        fix="a small count such as 3; 0 fails at the first non-finite step",
        ge=0,
    )

    @field_validator("micro_batch_size", mode="before")
    @classmethod
    def _a_count_or_auto(cls, value: Any) -> Any:
        """One problem for a bad value, not one per member of the union."""
        if value == "auto":
            return value
        if isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise _rule("must be a whole number of sequences of at least 1, or 'auto'")
        return value

    @field_validator("min_lr")
    @classmethod
    def _min_lr_below_lr(cls, min_lr: float, info: ValidationInfo) -> float:
        lr = info.data.get("lr")
        if lr is not None and min_lr > lr:
            raise _rule(f"must be in [0, lr] with lr={lr}")
        return min_lr

    @field_validator("warmup_steps")
    @classmethod
    def _warmup_below_max_steps(cls, warmup_steps: int, info: ValidationInfo) -> int:
        max_steps = info.data.get("max_steps")
        if max_steps is not None and warmup_steps >= max_steps:
            raise _rule(f"must be below max_steps={max_steps}")
        return warmup_steps

    @field_validator("decay_steps", mode="after")
    @classmethod
    def _decay_within_the_run(cls, decay_steps: int | None, info: ValidationInfo) -> int | None:
        kind, max_steps, warmup = (
            info.data.get("lr_schedule"),
            info.data.get("max_steps"),
            info.data.get("warmup_steps"),
        )
        if kind == "wsd" and decay_steps is None:
            raise _rule(
                "is empty, and lr_schedule 'wsd' decays over the last decay_steps steps",
                "set it, e.g. a fifth of max_steps",
            )
        if kind == "wsd" and max_steps is not None and warmup is not None and decay_steps > max_steps - warmup:
            raise _rule(
                f"is longer than the {max_steps - warmup} steps after the warm-up (max_steps={max_steps}, "
                f"warmup_steps={warmup})",
                f"use at most {max_steps - warmup}, or raise train.max_steps",
            )
        return decay_steps

    @field_validator("rewarm")
    @classmethod
    def _rewarm_needs_a_branch(cls, rewarm: bool, info: ValidationInfo) -> bool:
        if rewarm and not info.data.get("branch_from"):
            raise _rule(
                "is true, and this run is no branch: a run warms up from step 0 as it is",
                "set train.branch_from (or stoker run --branch-from URI), or leave rewarm false",
            )
        return rewarm
