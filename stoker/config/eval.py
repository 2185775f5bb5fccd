"""The eval section (``EvalConfig``): the validation loss during training, what the evaluation
of each committed checkpoint measures (``EVAL_SETS``), and the lm-evaluation-harness tasks."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from stoker.fields import NonBlank, _field, _rule, _Section

EVAL_SETS = ("loss", "bpb", "multiple_choice")  # eval.sets: what a checkpoint's evaluation measures


class EvalConfig(_Section):
    interval_steps: int = _field(100, "Steps between validation-loss evaluations.", ge=1)
    num_batches: int = _field(8, "Validation batches (of micro_batch_size per rank) per evaluation.", ge=1)
    per_checkpoint_enabled: bool = Field(
        True,
        description="Evaluate every committed checkpoint in its own task run (a separate "
        "process) while training goes on.",
    )
    sets: list[Literal["loss", "bpb", "multiple_choice"]] = Field(
        default_factory=lambda: list(EVAL_SETS),
        description="What the evaluation of a committed checkpoint (a process of its own) "
        "measures: 'loss' (validation loss and perplexity over the validation split; always "
        "listed), 'bpb' (bits per byte of the same windows: the loss per UTF-8 byte of text, so "
        "runs with other tokenizers compare; almost free), 'multiple_choice' (accuracy on "
        "stoker's vendored set of next-line questions about standard-library code, scored as "
        "HellaSwag is: eval.multiple_choice_items items).",
        json_schema_extra={"fix": "give a list of 'loss', 'bpb' and 'multiple_choice', with 'loss' in it"},
    )
    multiple_choice_items: int = _field(
        100,
        "Items of the vendored multiple-choice set (500 in all) that eval.sets 'multiple_choice' "
        "scores: the first N, each 4 forward rows of up to block_size tokens.",
        fix="a number from 1 to 500, e.g. 100",
        ge=1,
        le=500,
    )

    @field_validator("sets", mode="before")
    @classmethod
    def _known_sets(cls, sets: Any) -> Any:
        if isinstance(sets, str):  # one name, as --set eval.sets=bpb gives it
            sets = [sets]
        if not isinstance(sets, (list, tuple)):
            return sets
        unknown = [s for s in sets if s not in EVAL_SETS]
        if unknown:
            raise _rule(f"{', '.join(map(repr, unknown))}: not an evaluation set")
        if "loss" not in sets:
            raise _rule("leaves out 'loss', which every evaluation measures", "add 'loss' to the list")
        return list(dict.fromkeys(sets))  # each once, in the order given

    harness_tasks: list[NonBlank] = Field(
        default_factory=list,
        description="lm-evaluation-harness tasks (the 'harness' extra: pip install 'stoker[harness]') "
        "that `stoker harness` runs on an exported checkpoint: local-file tasks only, "
        "nothing is downloaded. 'stoker_mc' is stoker's vendored multiple-choice set as an "
        "lm-eval task; eval.harness_include adds your own. Empty: none.",
        json_schema_extra={"fix": "give task names, e.g. ['stoker_mc'], or an empty list"},
    )
    harness_include: list[NonBlank] = Field(
        default_factory=list,
        description="Folders of lm-eval task YAML files (e.g. dataset_path: json with "
        "dataset_kwargs.data_files naming a local file) whose tasks eval.harness_tasks may name, "
        "beside stoker's own (stoker/evalsets/harness).",
        json_schema_extra={"fix": "give folders that hold lm-eval task YAML files"},
    )
    harness_limit: int | None = _field(
        None,
        "Items of each harness task that are scored (the first N); empty: every item.",
        fix="a whole number of at least 1, or leave it empty for every item",
        ge=1,
    )

    @field_validator("harness_tasks", "harness_include", mode="before")
    @classmethod
    def _one_or_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value  # --set eval.harness_tasks=stoker_mc
