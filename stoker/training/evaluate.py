"""Evaluate one committed checkpoint in its own process: ``python -m stoker.training.evaluate``.

Loads only the model tensors from the checkpoint (never unpickles anything) and prints
an Evaluated event with the validation loss and perplexity over the whole validation
split (capped by --max-windows); a failure is printed as a Failure event. Runs on the GPU
when there is one (``--device``), with the run's precision (``engine.precision``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from functools import partial

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from stoker.core import events
from stoker.storage.checkpoints import COMMIT_FILE, rehydrate
from stoker.storage.shards import materialize
from stoker.storage.store import Store, default_cache_dir
from stoker.training.checkpoint import load_checkpoint
from stoker.training.data import TokenStream, eval_offsets, get_batch
from stoker.training.engine import Engine
from stoker.training.model import GPT
from stoker.training.train import RankErrorHandler, read_config


@torch.no_grad()
def evaluate_checkpoint(
    cfg,
    store: Store,
    checkpoint_key: str,
    shard_dir: str,
    cache_dir: str,
    max_windows: int = 256,
    batch_size: int = 16,
    device: torch.device | None = None,
) -> events.Evaluated:
    folder = rehydrate(
        store,
        checkpoint_key,
        cache_dir,  # fully checked against its manifest
        expected={"model_hash": cfg.model_hash()},
    )
    with open(os.path.join(folder, COMMIT_FILE)) as f:
        manifest = json.load(f)
    val = TokenStream(shard_dir, "val")
    device = device or default_device()
    engine = Engine.resolve(cfg, device, training=False)  # for its precision
    model = GPT(cfg.model, val.vocab_size, seed=None).to(device)  # every weight is loaded
    load_checkpoint(folder, model=model)
    model.eval()
    T = cfg.model.block_size
    offsets = eval_offsets(val.num_tokens, T, min(max_windows, max(1, val.num_tokens // T)))
    total, count = torch.zeros((), dtype=torch.float64, device=device), 0
    for i in range(0, len(offsets), batch_size):
        x, y = get_batch(val, T, offsets[i : i + batch_size])
        with engine.autocast():
            _, loss = model(x.to(device), y.to(device))
        total += loss.double() * len(x)
        count += len(x)
    loss = float(total) / count
    return events.Evaluated(
        checkpoint=store.url(checkpoint_key),
        step=manifest["step"],
        val_loss=loss,
        val_ppl=math.exp(min(loss, 50)),
        windows=count,
    )


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
    store = Store(cfg.storage.root, cfg.storage.storage_options)
    shard_dir = materialize(store, args.shards.rsplit("/", 1)[-1], args.cache_dir)
    result = evaluate_checkpoint(
        cfg,
        store,
        args.checkpoint,
        shard_dir,
        args.cache_dir,
        args.max_windows,
        device=torch.device(args.device) if args.device else None,
    )
    print(result.encode(), flush=True)


if __name__ == "__main__":
    main()
