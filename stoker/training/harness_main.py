"""lm-evaluation-harness on an exported checkpoint: ``python -m stoker.training.harness_main``.

    python -m stoker.training.harness_main <exported folder | checkpoint URI> --tasks stoker_mc \\
        [--include DIR ...] [--limit N] [--out results.json]

The 'harness' extra (pip install 'stoker[harness]'). A checkpoint URI is first exported
(``training.export``, the full sha256 check included) into a temporary folder, removed after.
The tasks are local-file tasks only: stoker's own (stoker/evalsets/harness: ``stoker_mc``, the
vendored multiple-choice set) and those of the --include folders; their names are checked
before anything is exported or loaded. Nothing comes from the Hugging Face Hub (the offline
variables are set before lm_eval is imported). The model runs as transformers'
``AutoModelForCausalLM`` (any family's export) in float32, behind ``ExportedModel``: an lm-eval
``TemplateLM`` (lm-eval's own pairing of context and continuation) that scores as lm-eval's "hf"
model does. Not "hf" itself: that model imports ``accelerate`` (lm_eval's [hf] extra), which a
one-device model never needs.

Prints a HarnessEvaluated event (a failure: a Failure event) and, with --out, writes the
metrics (and with --samples each item's log-likelihoods and verdicts) as JSON. It runs in a
process of its own: the orchestrator's rooms never import torch or lm_eval.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import tempfile
import time

from stoker.config.harness_tasks import OFFLINE_ENV, harness_problems, include_paths
from stoker.contracts import events
from stoker.failures import ConfigError
from stoker.process.quick_exit import quick_exit

os.environ.update(OFFLINE_ENV)  # before datasets, transformers or lm_eval read them


def stoker_mc_dataset(**_kwargs):
    """The items of stoker's vendored multiple-choice set as the 'test' split of a
    datasets.DatasetDict, in the file's order: stoker_mc.yaml's custom_dataset. Read by stoker's
    own loader (the file's sha256 checked, the meta line left out), so the harness scores the
    very items stoker's evaluation does."""
    import datasets

    from stoker.training.scoring import load_multiple_choice

    items = load_multiple_choice()
    rows = [{"context": i.context, "endings": list(i.endings), "label": i.label, "source": i.source} for i in items]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def is_checkpoint_uri(source: str) -> bool:
    """A checkpoint's URI ({root}/runs/{run}/checkpoints/step-N) rather than an exported folder."""
    return "/checkpoints/step-" in source.rstrip("/") and not os.path.isfile(os.path.join(source, "config.json"))


def _finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def metrics_of(results: dict) -> dict[str, dict[str, float]]:
    """{task: {metric: value}} from simple_evaluate's results: 'acc,none' read as 'acc', the
    standard errors kept as '<metric>_stderr', anything not a finite number left out."""
    out = {}
    for task, values in results["results"].items():
        out[task] = {k.split(",")[0]: float(v) for k, v in values.items() if k != "alias" and _finite(v)}
    return out


def samples_of(results: dict) -> dict[str, list[dict]]:
    """{task: [{doc_id, target, loglikelihoods, acc}]} per item, in document order."""
    out = {}
    for task, samples in results.get("samples", {}).items():
        rows = []
        for s in sorted(samples, key=lambda s: s["doc_id"]):
            rows.append(
                {
                    "doc_id": s["doc_id"],
                    "target": s["target"],
                    "loglikelihoods": [float(r[0][0]) for r in s["resps"]],  # [[(ll, is_greedy)]] per choice
                    "acc": float(s["acc"]) if "acc" in s else None,
                }
            )
        out[task] = rows
    return out


def _lm_class():
    """ExportedModel, built on first use (lm_eval and transformers are imported only here)."""
    import torch
    import torch.nn.functional as F
    from lm_eval.api.model import TemplateLM
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
    from transformers import AutoModelForCausalLM, AutoTokenizer

    class ExportedModel(TemplateLM):
        """An exported stoker checkpoint (a Hugging Face folder of any family) as an lm-eval
        model, one device, float32. Scores as lm-eval's HFLM does: context + continuation kept
        to the model's last max_position_embeddings + 1 ids (the context cut from the left), the continuation's log-probabilities
        summed; greedy generation for generate_until tasks."""

        def __init__(self, folder: str, device: str = "cpu", batch_size: int = 8):
            super().__init__()
            self.tokenizer = AutoTokenizer.from_pretrained(folder)
            self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to(device).eval()
            self.where = torch.device(device)
            self.batch_size = batch_size
            self.max_length = int(self.model.config.max_position_embeddings)  # GPT-2's n_positions

        @property
        def eot_token_id(self) -> int:
            return self.tokenizer.eos_token_id

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
            return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))

        @torch.no_grad()
        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
            out = []
            for start in range(0, len(requests), self.batch_size):
                batch = []
                for _, context, continuation in requests[start : start + self.batch_size]:
                    ids = (context + continuation)[-(self.max_length + 1) :]
                    batch.append((ids, min(len(continuation), len(ids) - 1)))
                width = max(len(ids) for ids, _ in batch) - 1
                x = torch.full((len(batch), width), self.eot_token_id, dtype=torch.long)
                for b, (ids, _) in enumerate(batch):
                    x[b, : len(ids) - 1] = torch.tensor(ids[:-1])  # right-padded: causal, never seen
                logprobs = F.log_softmax(self.model(x.to(self.where)).logits.float(), dim=-1).cpu()  # (B, T, V)
                for b, (ids, n) in enumerate(batch):
                    target = torch.tensor(ids[len(ids) - n :])
                    rows = logprobs[b, len(ids) - 1 - n : len(ids) - 1]  # (n, V): the positions predicting them
                    score = float(rows.double().gather(1, target[:, None]).sum())
                    out.append((score, bool((rows.argmax(-1) == target).all())))
            return out

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
            out = []
            for (string,) in [r.args for r in requests]:
                windows = [
                    make_disjoint_window(w)
                    for w in get_rolling_token_windows(
                        token_list=self.tok_encode(string),
                        prefix_token=self.prefix_token_id,
                        max_seq_len=self.max_length,
                        context_len=1,
                    )
                ]
                scores = self._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in windows])
                out.append(sum(score for score, _ in scores))
            return out

        @torch.no_grad()
        def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
            out = []
            for context, gen_kwargs in [r.args for r in requests]:
                until = gen_kwargs.get("until") or [self.tokenizer.decode([self.eot_token_id])]
                until = [until] if isinstance(until, str) else list(until)
                new = int(gen_kwargs.get("max_gen_toks", 256))
                ids = self.tok_encode(context)[-max(1, self.max_length - new) :]
                made = self.model.generate(
                    torch.tensor([ids], device=self.where),
                    max_new_tokens=min(new, self.max_length - len(ids)),
                    do_sample=False,
                    pad_token_id=self.eot_token_id,
                )[0, len(ids) :]
                text = self.tokenizer.decode(made.tolist())
                for stop in until:
                    text = text.split(stop)[0]
                out.append(text)
            return out

    return ExportedModel


def evaluate_folder(
    folder: str,
    tasks: list[str],
    include: list[str],
    limit: int | None = None,
    batch_size: int = 8,
    device: str = "cpu",
    log_samples: bool = False,
) -> dict:
    """simple_evaluate on the exported `folder`: {"metrics", "num_items", "versions",
    ["samples"]}."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=include_paths(include), include_defaults=False)
    results = lm_eval.simple_evaluate(
        model=_lm_class()(folder, device, batch_size),
        tasks=tasks,
        task_manager=manager,
        limit=limit,
        log_samples=log_samples,
        bootstrap_iters=1000,
    )
    out = {
        "metrics": metrics_of(results),
        "num_items": {
            t: int(n.get("effective", n.get("original", 0))) for t, n in results.get("n-samples", {}).items()
        },
        "versions": {t: str(v) for t, v in results.get("versions", {}).items()},
    }
    if log_samples:
        out["samples"] = samples_of(results)
    return out


def run(args: argparse.Namespace) -> events.HarnessEvaluated:
    """Check the names, export the checkpoint when given one, run the harness, write --out."""
    found = harness_problems(args.tasks, args.include, "--tasks", "--include")
    if not args.tasks:
        found = ["--tasks: no task named; give task names, e.g. --tasks stoker_mc"]
    if found:
        raise ConfigError(found)
    t0 = time.monotonic()
    checkpoint, step = None, None
    tmp = None
    folder = args.source
    try:
        if is_checkpoint_uri(args.source):
            from stoker.training.export import export_checkpoint

            tmp = tempfile.mkdtemp(prefix="stoker-harness-")
            exported = export_checkpoint(
                args.source,
                os.path.join(tmp, "model"),
                args.cache_dir,
                json.loads(os.environ.get("STOKER_STORAGE_OPTIONS", "{}")),
            )
            folder, checkpoint, step = exported.folder, exported.checkpoint, exported.step
        elif not os.path.isfile(os.path.join(folder, "config.json")):
            raise ConfigError(
                [
                    f"{args.source!r}: neither a checkpoint URI nor an exported folder (no config.json); give "
                    "{root}/runs/{run}/checkpoints/step-NNNNNNNN or a folder written by `stoker export`"
                ]
            )
        else:
            with open(os.path.join(folder, "config.json")) as f:
                made = json.load(f).get("stoker", {})
            checkpoint, step = made.get("checkpoint"), made.get("step")
        found = evaluate_folder(
            folder, args.tasks, args.include, args.limit, args.batch_size, args.device, log_samples=args.samples
        )
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    done = events.HarnessEvaluated(
        checkpoint=checkpoint,
        step=step,
        tasks=list(args.tasks),
        metrics=found["metrics"],
        num_items=found["num_items"],
        out=os.path.abspath(args.out) if args.out else None,
        seconds=time.monotonic() - t0,
    )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**done.to_dict(), **found, "model": folder if not tmp else None}, f, indent=2, sort_keys=True)
    return done


def main(argv: list[str] | None = None) -> int:
    from stoker.storage.store import default_cache_dir

    p = argparse.ArgumentParser(description="lm-evaluation-harness tasks on an exported stoker checkpoint.")
    p.add_argument("source", help="an exported folder (stoker export) or {root}/runs/{run}/checkpoints/step-NNNNNNNN")
    p.add_argument("--tasks", required=True, help="task names, comma-separated, e.g. stoker_mc")
    p.add_argument("--include", action="append", default=[], help="a folder of lm-eval task YAML files (repeatable)")
    p.add_argument("--limit", type=int, default=None, help="the first N items of each task")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default=None, help="write the metrics as JSON here")
    p.add_argument("--samples", action="store_true", help="also write each item's log-likelihoods to --out")
    p.add_argument("--cache-dir", default=default_cache_dir())
    args = p.parse_args(argv)
    args.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    return events.report_outcome(lambda: run(args))


if __name__ == "__main__":
    quick_exit(main())
