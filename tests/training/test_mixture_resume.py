"""A mixture on real gloo ranks (forked, tests.forked_ranks): resumed from the unbroken run's
step-4 checkpoint, before the schedule's change at step 5 (a new launch: no rank is killed),
it ends bit for bit where the unbroken run does; resumed at another world size it trains on
the same windows (torch.equal, step by step) with the same losses (assert_close: another
world size sums the gradients in another order, so its weights cannot be bitwise those of 2
ranks). Each source's validation loss at step 8 is the step-8 checkpoint's own on that
source's validation windows, computed here apart from the ranks."""

import os

import torch
import torch.distributed.checkpoint as dcp

from stoker.storage.checkpoints import list_checkpoints
from tests.conftest import ROOT, prepare_shards, tiny_dict, train_losses
from tests.forked_ranks import run_forked

SOURCES = [
    {"name": "stdlib", "source": "builtin:stdlib", "weight": 0.75, "max_bytes": 200_000},
    {"name": "docs", "source": os.path.join(ROOT, "docs"), "weight": 0.25},
]
# the weights flip after step 5: steps 1-5 mostly stdlib, 6-8 mostly docs
SCHEDULE = [{"at_step": 5, "weights": {"stdlib": 0.25, "docs": 0.75}}]


def _tensors(path):
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.items()}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return sd


def _unbroken(tmp_path_factory):
    """One unbroken mixture run on 2 ranks: 8 steps, checkpoints at 4 and 8."""
    from stoker.config import load_config

    root = "file://" + str(tmp_path_factory.mktemp("mix") / "store")
    cfg = load_config(
        tiny_dict(
            root,
            run_name="mix",
            data={"val_fraction": 0.1, "sources": SOURCES, "schedule": SCHEDULE},
            checkpoint={"interval_steps": 4, "keep_latest_k": 4},  # step 4 stays for both resumes
        )
    )
    store, shards = prepare_shards(cfg)
    store.write_bytes("runs/mix/config.json", cfg.to_json().encode())
    url = store.url("runs/mix/config.json")
    records = run_forked(url, shards.key, nproc=2)
    return cfg, store, shards, url, records


def test_a_mixture_resumed_across_a_schedule_change_ends_like_an_unbroken_run(tmp_path_factory):
    """One unbroken run, resumed from step 4 at 2 ranks (bitwise) and at 1 rank (same windows)."""
    cfg, store, shards, url, records = _unbroken(tmp_path_factory)
    whole = train_losses(records)
    assert sorted(whole) == list(range(1, 9))
    resumed = run_forked(url, shards.key, resume="runs/mix/checkpoints/step-00000004", nproc=2)
    losses = train_losses(resumed)
    assert sorted(losses) == [5, 6, 7, 8] and all(losses[s] == whole[s] for s in losses)
    newest = list_checkpoints(store, "mix")[0]
    assert newest.key.endswith("step-00000008.a1")
    a, b = _tensors(store.local_path("runs/mix/checkpoints/step-00000008")), _tensors(store.local_path(newest.key))
    assert a.keys() == b.keys()
    for k in a:  # (an RNG state never drawn from is NaN in both)
        assert torch.equal(a[k], b[k]) or (a[k].isnan().all() and b[k].isnan().all()), k
    # what each source gave, told at every log step: the schedule's flip shows
    seen = {r["step"]: r["sources"] for r in records if r["event"] == "train"}
    tokens = {s: {n: v["tokens"] for n, v in seen[s].items()} for s in (5, 8)}
    assert tokens[5] == {"stdlib": 30 * 32, "docs": 10 * 32}  # 40 windows of 32 tokens, 3:1
    assert tokens[8]["docs"] - tokens[5]["docs"] == 18 * 32  # then 1:3 over 24 windows
    assert seen[8]["docs"]["epochs"] > 0
    evals = [r for r in records if r["event"] == "eval"]
    assert all(set(e["sources"]) == {"stdlib", "docs"} for e in evals)
    [at_8] = [e for e in evals if e["step"] == 8]
    expected = _val_losses_of(cfg, store, shards, "runs/mix/checkpoints/step-00000008")
    for name in ("stdlib", "docs"):  # the event's values: rounded to 6 places
        torch.testing.assert_close(torch.tensor(at_8["sources"][name]), expected[name], msg=name)
    _at_another_world_size(cfg, store, shards, records)


def _val_losses_of(cfg, store, shards, checkpoint_key) -> dict[str, torch.Tensor]:
    """Each source's validation loss, computed here apart from the ranks' evaluation: the
    checkpoint's tensors (read with DCP) in a model on one process, a plain forward pass and
    cross-entropy over all the evaluation's windows of that source's val split at once (2
    batches x 2 windows x 2 ranks, each window's offset as the evaluation places it)."""
    import torch.nn.functional as F

    from stoker.families import build_model
    from stoker.training.data import TokenStream, eval_offsets, get_batch

    saved = _tensors(store.local_path(checkpoint_key))
    model = build_model(cfg.model, shards.vocab_size, seed=None)
    mine = {k.removeprefix("model."): v for k, v in saved.items() if k.startswith("model.")}
    missing, unexpected = model.load_state_dict(mine, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected  # tied: the checkpoint stores wte once
    assert model.lm_head.weight is model.wte.weight
    model.eval()
    T = cfg.model.block_size
    out = {}
    for s in shards.sets:
        val = TokenStream(store.local_path(s.key), "val")
        x, y = get_batch(val, T, eval_offsets(val.num_tokens, T, cfg.eval.num_batches * cfg.train.micro_batch_size * 2))
        with torch.no_grad():
            logits = model(x)[0]  # (B, T, vocab)
        out[s.name] = F.cross_entropy(logits.flatten(0, 1), y.flatten())
    return out


def _at_another_world_size(cfg, store, shards, records):
    from stoker.config import RunConfig
    from stoker.training.data import TokenStream, TrainWindows, train_batch

    streams = {s.name: TokenStream(store.local_path(s.key), "train") for s in shards.sets}
    windows = TrainWindows.of_run(cfg, streams)
    for step in range(3, 8):  # 2 ranks x 2 micro-steps of 2, and 1 rank x 4 micro-steps of 2
        two = torch.cat([train_batch(windows, 2, step, rank, m, 2)[0] for rank in (0, 1) for m in (0, 1)])
        one = torch.cat([train_batch(windows, 2, step, 0, m, 4)[0] for m in range(4)])
        assert torch.equal(one, two)
    # 1 rank, and epoch limits: stdlib has given 30 windows by step 5 and 32 by step 6 (warn
    # after 31), docs 22 by step 7 and 28 by step 8 (stop after 25): the run ends at step 7
    w = dict(zip(windows.names, windows.mixture.windows.tolist()))
    limits = {
        "stdlib": {"max_epochs": 31 / w["stdlib"], "at_max_epochs": "warn"},
        "docs": {"max_epochs": 25 / w["docs"]},
    }
    raw = RunConfig.model_validate_json(store.read_bytes("runs/mix/config.json")).model_dump(mode="json")
    raw["launch"]["nproc_per_node"] = 1
    raw["data"]["sources"] = [{**s, **limits[s["name"]]} for s in raw["data"]["sources"]]
    store.write_bytes("runs/mix/config-1.json", RunConfig.model_validate(raw).to_json().encode())
    resumed = run_forked(
        store.url("runs/mix/config-1.json"), shards.key, resume="runs/mix/checkpoints/step-00000004", nproc=1
    )
    said = [(r["step"], r["source"], r["action"]) for r in resumed if r["event"] == "epoch_limit"]
    assert said == [(7, "docs", "stop"), (6, "stdlib", "warn")]
    assert 7 in [c.step for c in list_checkpoints(store, "mix")]  # the run ends with a checkpoint
    whole, losses = train_losses(records), train_losses(resumed)
    assert sorted(losses) == [5, 6, 7]
    torch.testing.assert_close(
        torch.tensor([losses[s] for s in losses], dtype=torch.float32),
        torch.tensor([whole[s] for s in losses], dtype=torch.float32),
    )
