"""Evaluate one committed checkpoint in its own process: ``python -m stoker.training.evaluation_main``.

Loads only the model tensors from the checkpoint (never unpickles anything) and prints
an Evaluated event with the validation loss and perplexity over the whole validation
split (capped by --max-windows) and the other sets of eval.sets: the bits per byte of the
same windows, the accuracy on the vendored multiple-choice set (training.scoring); a failure
is printed as a Failure event. Runs on the GPU
when there is one (``--device``), with the run's precision (``engine.precision``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from functools import partial

import torch
from tokenizers import Tokenizer
from torch.distributed.elastic.multiprocessing.errors import record

from stoker.config.data import DEFAULT_SOURCE_NAME
from stoker.contracts import events
from stoker.contracts.results import parse_shards_arg
from stoker.families import build_model
from stoker.process.quick_exit import quick_exit
from stoker.storage.checkpoints import COMMIT_FILE, rehydrate
from stoker.storage.layout import SHARDS_FILE, run_file_key
from stoker.storage.shards import TOKENIZER_FILE, materialize, shard_set_name
from stoker.storage.store import Store, default_cache_dir
from stoker.training.checkpoint import load_checkpoint
from stoker.training.data import TokenStream, eval_offsets, get_batch
from stoker.training.engine import Engine
from stoker.training.scoring import (
    MULTIPLE_CHOICE_TASK,
    ChoiceScores,
    HeldOut,
    add_window_scores,
    encode_items,
    load_multiple_choice,
    score_choices,
    token_byte_counts,
    token_nll,
)
from stoker.training.train import RankErrorHandler, read_config


@torch.no_grad()
def evaluate_checkpoint(
    cfg,
    store: Store,
    checkpoint_key: str,
    shard_dirs: dict[str, str] | str,
    cache_dir: str,
    max_windows: int = 256,
    batch_size: int = 16,
    device: torch.device | None = None,
) -> events.Evaluated:
    """Evaluate one checkpoint on the sets of cfg.eval.sets (see held_out_scores and
    multiple_choice_scores). A mixture's sources (shard_dirs: one folder per source) are
    scored each on its own validation split; val_loss and bits_per_byte are their means."""
    if isinstance(shard_dirs, str):
        shard_dirs = {DEFAULT_SOURCE_NAME: shard_dirs}
    folder = rehydrate(
        store,
        checkpoint_key,
        cache_dir,  # fully checked against its manifest
        expected={"model_hash": cfg.model_hash()},
    )
    with open(os.path.join(folder, COMMIT_FILE)) as f:
        manifest = json.load(f)
    vals = {name: TokenStream(d, "val") for name, d in shard_dirs.items()}
    first = next(iter(shard_dirs.values()))
    device = device or default_device()
    engine = Engine.resolve(cfg, device, training=False)  # for its precision
    vocab_size = next(iter(vals.values())).vocab_size
    model = build_model(cfg.model, vocab_size, seed=None).to(device)  # every weight is loaded
    model.document_end_id = next(iter(vals.values())).eot_id  # masked as in training (model.attention)
    load_checkpoint(folder, model=model)
    model.eval()
    sets = set(cfg.eval.sets)
    tokenizer = Tokenizer.from_file(os.path.join(first, TOKENIZER_FILE)) if sets - {"loss"} else None
    scored = {
        name: held_out_scores(
            model, val, cfg.model.block_size, max_windows, batch_size, engine, tokenizer if "bpb" in sets else None
        )
        for name, val in vals.items()
    }
    loss = sum(h.loss for h in scored.values()) / len(scored)
    bpbs = [h.bits_per_byte for h in scored.values()]
    bpb = None if any(b is None for b in bpbs) else sum(bpbs) / len(bpbs)
    windows = sum(h.num_tokens for h in scored.values()) // cfg.model.block_size
    per_source = None
    if cfg.data.is_mixture():
        per_source = {
            name: {
                "val_loss": round(h.loss, 6),
                "bits_per_byte": None if h.bits_per_byte is None else round(h.bits_per_byte, 6),
                "windows": h.num_tokens // cfg.model.block_size,
            }
            for name, h in scored.items()
        }
    mc = clean = None
    if "multiple_choice" in sets:
        mc, ids = multiple_choice_scores(model, tokenizer, cfg.model.block_size, cfg.eval.multiple_choice_items, engine)
        found = items_found(store, cfg)
        if found is not None:  # decontaminated: the items not found in the training data apart
            clean = mc.subset(torch.tensor([f"{MULTIPLE_CHOICE_TASK}:{i}" not in found for i in ids], dtype=torch.bool))
    return events.Evaluated(
        checkpoint=store.url(checkpoint_key),
        step=manifest["step"],
        val_loss=loss,
        val_ppl=math.exp(min(loss, 50)),
        windows=windows,
        bits_per_byte=bpb,
        mc_accuracy=mc.accuracy if mc else None,
        mc_accuracy_norm=mc.accuracy_norm if mc else None,
        num_mc_items=len(mc.labels) if mc else None,
        mc_accuracy_clean=clean.accuracy if clean is not None and len(clean.labels) else None,
        mc_accuracy_norm_clean=clean.accuracy_norm if clean is not None and len(clean.labels) else None,
        num_mc_items_clean=len(clean.labels) if clean is not None else None,
        sources=per_source,
    )


@torch.no_grad()
def held_out_scores(
    model: torch.nn.Module,
    val: TokenStream,
    block_size: int,
    max_windows: int,
    batch_size: int,
    engine: Engine,
    tokenizer=None,
) -> HeldOut:
    """The loss of the validation split's fixed windows (eval_offsets: evenly spaced, at most
    max_windows), over the tokenizer's ids; with a tokenizer, also their bits per byte: the
    nats of every predicted token that decodes to bytes / (ln 2 x those bytes), the bytes
    counted exactly per id, less a SentencePiece dummy prefix after a bos (scoring.token_byte_counts); a window's first token is never
    predicted, and the end-of-text (no bytes) is left out of both sums."""
    T, device = block_size, engine.device
    byte_counts = None
    if tokenizer is not None:
        byte_counts = torch.from_numpy(token_byte_counts(tokenizer, val.vocab_size)).to(device)
    offsets = eval_offsets(val.num_tokens, T, min(max_windows, max(1, val.num_tokens // T)))
    held = HeldOut()
    for i in range(0, len(offsets), batch_size):
        x, y = get_batch(val, T, offsets[i : i + batch_size])
        x, y = x.to(device), y.to(device)
        add_window_scores(held, token_nll(model, x, y, engine.autocast), y, byte_counts, x)
    return held


def multiple_choice_scores(
    model: torch.nn.Module, tokenizer, block_size: int, num_items: int, engine: Engine
) -> tuple[ChoiceScores, list[int | None]]:
    """The vendored multiple-choice set's first num_items items (its sha256 checked), scored,
    and their numbers in the set."""
    chosen = load_multiple_choice(limit=num_items)
    items = encode_items(tokenizer, chosen, block_size)
    return score_choices(model, items, engine.device, engine.autocast), [c.id for c in chosen]


def items_found(store: Store, cfg) -> set[str] | None:
    """The evaluation items data.decontaminate found in the run's training data (its
    shards.json), or None where it did not decontaminate (or the record cannot be read)."""
    try:
        dedup = store.read_json(run_file_key(cfg.resolved_run_name(), SHARDS_FILE)).get("dedup") or []
    except (FileNotFoundError, ValueError, AttributeError):
        return None
    if not any(d.get("decontaminate") for d in dedup):
        return None
    return {item for d in dedup for item in d.get("items") or {}}


def default_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


@partial(record, error_handler=RankErrorHandler())
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Evaluate a stoker checkpoint.")
    p.add_argument("--config", required=True)
    p.add_argument("--checkpoint", required=True, help="checkpoint key under the store root")
    p.add_argument("--shards", required=True)
    p.add_argument("--max-windows", type=int, default=256)
    p.add_argument("--cache-dir", default=default_cache_dir())
    p.add_argument("--device", default=None, help="e.g. cuda:0 or cpu (default: a GPU when there is one)")
    args = p.parse_args(argv)
    cfg = read_config(args.config)
    store = Store.of(cfg.storage)
    shard_dirs = {
        name: materialize(store, shard_set_name(key), args.cache_dir) for name, key in parse_shards_arg(args.shards)
    }
    result = evaluate_checkpoint(
        cfg,
        store,
        args.checkpoint,
        shard_dirs,
        args.cache_dir,
        args.max_windows,
        device=torch.device(args.device) if args.device else None,
    )
    print(result.encode(), flush=True)


if __name__ == "__main__":
    main()
    quick_exit(0)
