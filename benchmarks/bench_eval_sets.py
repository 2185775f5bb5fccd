"""What the evaluation sets beyond the loss cost a checkpoint's evaluation, against the
validation loss alone measured in the same run (eval.sets, training.evaluation_main).

On one GPT of the tiny-cpu recipe's shape (CPU, or the first CUDA device with bf16 autocast),
random weights, a byte-level BPE trained on a slice of the standard library:
- 'loss': --windows validation windows of block_size tokens (the evaluation's default 256);
- 'loss+bpb': the same, with the byte counts (the per-id table built each time) and sums;
- 'mc': the vendored multiple-choice set's first --items items (load, checksum, encode, score).
Rounds alternate the variants; medians. Prints each one's seconds and its ratio to 'loss'.

    python -m benchmarks.bench_eval_sets [--items 100 --windows 256 --rounds 3] [--smoke]

--smoke: 2 items, 8 windows, one round, a tokenizer trained on fewer files; it checks that the
benchmark runs, its figures mean nothing.
"""

from __future__ import annotations

import argparse
import glob
import os
import statistics
import sysconfig
import time
from contextlib import nullcontext

import torch


def _tokenizer(vocab: int, num_files: int = 40):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:num_files]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train(files, trainer)
    return tok


def main(argv: list[str] | None = None) -> None:
    from stoker.config import load_config
    from stoker.families.gpt2.model import GPT
    from stoker.training.scoring import (
        HeldOut,
        add_window_scores,
        encode_items,
        load_multiple_choice,
        score_choices,
        token_byte_counts,
        token_nll,
    )

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--items", type=int, default=100)
    p.add_argument("--windows", type=int, default=256)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="a few items and windows, one round: checks the benchmark runs")
    args = p.parse_args(argv)
    if args.smoke:
        args.items, args.windows, args.batch, args.rounds = 2, 8, 4, 1
    cfg = load_config("tiny-cpu")
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda" else nullcontext
    tok = _tokenizer(cfg.tokenizer.vocab_size, 10 if args.smoke else 40)
    V, T = tok.get_vocab_size(), cfg.model.block_size
    model = GPT(cfg.model, V, seed=0).to(device).eval()
    windows = torch.randint(0, V, (args.windows, T + 1), generator=torch.Generator().manual_seed(0))

    def held_out(with_bytes: bool) -> None:
        counts = torch.from_numpy(token_byte_counts(tok, V)).to(device) if with_bytes else None
        held = HeldOut()
        for i in range(0, args.windows, args.batch):
            batch = windows[i : i + args.batch].to(device)
            x, y = batch[:, :-1], batch[:, 1:]
            add_window_scores(held, token_nll(model, x, y, autocast), y, counts)

    def multiple_choice() -> None:
        score_choices(model, encode_items(tok, load_multiple_choice(limit=args.items), T), device, autocast)

    variants = {"loss": lambda: held_out(False), "loss+bpb": lambda: held_out(True), "mc": multiple_choice}
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    with torch.no_grad():
        for _ in range(args.rounds):
            for name, run in variants.items():
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                run()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                seconds[name].append(time.perf_counter() - t0)
    base = statistics.median(seconds["loss"])
    print(f"{device}, tiny-cpu model, {args.windows} windows, {args.items} multiple-choice items, {args.rounds} rounds")
    for name, values in seconds.items():
        m = statistics.median(values)
        print(f"  {name:9s} {m:7.2f} s   x{m / base:.2f} of 'loss'")


if __name__ == "__main__":
    main()
