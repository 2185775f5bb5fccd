"""The lm-evaluation-harness extra (training.harness_main, launch.harness_child, `stoker harness`): real
lm_eval on a checkpoint trained by a real (forked) rank and exported as GPT-2. Its `acc` on
stoker_mc (the vendored multiple-choice set as an lm-eval task) equals stoker's own scorer's
summed-log-likelihood accuracy on the same items, item by item; bad names, folders and a
missing lm_eval are one error before anything is exported."""

import json
import os
import subprocess
import sys

import pytest
import torch
from tokenizers import Tokenizer

from stoker import preflight
from stoker.config.harness_tasks import OFFLINE_ENV, harness_problems, local_tasks
from stoker.contracts import events
from stoker.families.gpt2.model import GPT
from stoker.training.checkpoint import load_checkpoint
from stoker.training.scoring import ChoiceRows, encode_items, load_multiple_choice, score_choices
from tests.conftest import ROOT, one_rank_run

RUN = "harness"
CHECKPOINT = f"runs/{RUN}/checkpoints/step-00000004"
NUM_ITEMS = 20
BLOCK = 128  # every ending (at most 72 characters) fits whole; most contexts are cut from the left


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run folder as the flow pins it, and a checkpoint one real rank committed after 4 steps."""
    return one_rank_run(tmp_path_factory, RUN, model={"block_size": BLOCK})[:3]


def _cli(*args, timeout=600):
    env = {**os.environ, **OFFLINE_ENV}
    return subprocess.run(
        [sys.executable, "-m", "stoker.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env
    )


def _harness_rows(tokenizer: Tokenizer, context: str, ending: str, block_size: int) -> tuple[list[int], int]:
    """An item's row as lm-eval's HFLM builds it (TemplateLM._encode_pair, _loglikelihood_tokens):
    the context's trailing whitespace moved to the ending, context + ending encoded whole and cut
    after the context's own ids, at most block_size + 1 ids kept from the right."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, ending = context[:-n_spaces], context[-n_spaces:] + ending
    whole = tokenizer.encode(context + ending, add_special_tokens=False).ids
    ctx = tokenizer.encode(context, add_special_tokens=False).ids
    end = whole[len(ctx) :]
    return (ctx + end)[-(block_size + 1) :], len(end)


def test_harness_acc_on_stoker_mc_equals_stokers_scorer_on_the_same_items(trained, tmp_path):
    """`stoker harness` on the run's newest checkpoint ('latest'): lm_eval's per-choice
    log-likelihoods equal our scorer's (training.scoring.score_choices, our GPT, the checkpoint
    read by stoker) on the ids lm-eval scores, so every item's choice and `acc` are the same."""
    cfg, store, shards = trained
    out = tmp_path / "results.json"
    done = _cli(
        "harness",
        *("--set", f"storage.root={cfg.storage.root}", "--set", f"run_name={RUN}"),
        *("--tasks", "stoker_mc", "--limit", str(NUM_ITEMS), "--out", str(out), "--samples"),
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"step 4 of {store.url(CHECKPOINT)}" in done.stdout and "stoker_mc: acc " in done.stdout
    result = json.loads(out.read_text())
    assert result["event"] == "harness" and result["num_items"] == {"stoker_mc": NUM_ITEMS}
    samples = result["samples"]["stoker_mc"]

    items = load_multiple_choice(limit=NUM_ITEMS)
    assert [s["doc_id"] for s in samples] == list(range(NUM_ITEMS))  # the first N, in the file's order
    assert [int(s["target"]) for s in samples] == [i.label for i in items]

    tokenizer = Tokenizer.from_file(os.path.join(store.local_path(shards.key), "tokenizer.json"))
    rows = []
    for item in items:
        pairs = [_harness_rows(tokenizer, item.context, ending, BLOCK) for ending in item.endings]
        rows.append(ChoiceRows([r for r, _ in pairs], [n for _, n in pairs], item.label))
    model = GPT(cfg.model, shards.vocab_size, seed=None)
    load_checkpoint(store.local_path(CHECKPOINT), model=model)
    ours = score_choices(model.eval(), rows, torch.device("cpu"), items_per_batch=5)
    theirs = torch.tensor([s["loglikelihoods"] for s in samples], dtype=torch.float64)
    torch.testing.assert_close(ours.logprob, theirs, rtol=1e-5, atol=1e-4)
    assert ours.predictions.tolist() == theirs.argmax(1).tolist()  # each item's choice
    assert [s["acc"] for s in samples] == (ours.predictions == ours.labels).double().tolist()
    assert result["metrics"]["stoker_mc"]["acc"] == ours.accuracy  # exactly

    # stoker's own encoding (context and ending tokenized apart) scores a few ids otherwise:
    # how often its choice agrees with lm-eval's, for the report (not a requirement)
    own = score_choices(model, encode_items(tokenizer, items, BLOCK), torch.device("cpu"))
    agree = int((own.predictions == ours.predictions).sum())
    print(
        f"\nharness acc {ours.accuracy:.3f} = stoker scorer on lm-eval's ids; stoker's own encoding: "
        f"acc {own.accuracy:.3f}, same choice on {agree}/{NUM_ITEMS} items; {result['seconds']:.1f}s"
    )


def test_an_unknown_task_name_is_one_error_naming_the_tasks_there_before_any_export(trained, tmp_path):
    cfg, store, _ = trained
    done = _cli("harness", "--checkpoint", store.url(CHECKPOINT), "--tasks", "stoker_mc,hellaswag_local")
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    assert "--tasks: 'hellaswag_local': no task file in" in done.stderr
    assert "the tasks there: stoker_mc" in done.stderr
    assert "Traceback" not in done.stderr
    # the process itself checks them first too (called directly, with an include folder)
    mine = tmp_path / "tasks"
    mine.mkdir()
    (mine / "my_task.yaml").write_text(
        "task: my_task\ndataset_path: json\ndataset_kwargs: {data_files: {test: /nowhere.jsonl}}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: q\ndoc_to_choice: c\ndoc_to_target: a\n"
    )
    said = subprocess.run(
        [sys.executable, "-m", "stoker.training.harness_main", store.url(CHECKPOINT), "--tasks", "nope"]
        + ["--include", str(mine), "--cache-dir", str(tmp_path / "cache")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    [failure] = [e for e in map(events.decode, said.stdout.splitlines()) if isinstance(e, events.Failure)]
    assert said.returncode == 1 and failure.type == "ConfigError"
    assert "'nope'" in failure.message and "the tasks there: my_task, stoker_mc" in failure.message
    assert not (tmp_path / "cache").exists()  # refused before the checkpoint was read


def test_harness_fields_are_checked_by_the_preflight(tiny_config, tmp_path, monkeypatch):
    assert local_tasks([]) == ["stoker_mc"]
    assert harness_problems([], ["/not/there"]) == []  # no task asked for: nothing to check
    assert preflight.problems(tiny_config(eval={"harness_tasks": ["stoker_mc"]})) == []

    cfg = tiny_config(eval={"harness_tasks": "stoker_mc", "harness_include": [str(tmp_path / "absent")]})
    assert cfg.eval.harness_tasks == ["stoker_mc"]  # one name, as --set gives it
    assert preflight.problems(cfg) == [
        f"eval.harness_include: {str(tmp_path / 'absent')!r} is not a folder; give a folder of lm-eval task YAML files."
    ]
    [unknown] = preflight.problems(tiny_config(eval={"harness_tasks": ["stoker_mc", "arc_easy"]}))
    assert unknown.startswith("eval.harness_tasks: 'arc_easy': no task file in ")
    assert unknown.endswith("the tasks there: stoker_mc (add your task's folder to eval.harness_include).")

    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as on a host without the extra
    assert preflight.problems(tiny_config(eval={"harness_tasks": ["stoker_mc"]})) == [
        "eval.harness_tasks: needs lm-evaluation-harness (the lm_eval package), which is not installed "
        "here; pip install 'stoker[harness]', or ask for no harness task."
    ]


def test_a_bad_harness_limit_names_the_field_and_the_fix(tiny_config):
    from stoker.failures import ConfigError

    with pytest.raises(ConfigError) as err:
        tiny_config(eval={"harness_limit": 0})
    assert "eval.harness_limit" in str(err.value) and "at least 1" in str(err.value)
