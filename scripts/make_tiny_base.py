"""Make a tiny random Hugging Face base model, locally (no hub): what the tiny-llama-cpu recipe
starts from, and what the tests load.

    python scripts/make_tiny_base.py ./tiny-llama-base                # Llama-3.2-style
    python scripts/make_tiny_base.py ./tiny-qwen-base --style qwen2   # q/k/v bias, untied
    python scripts/make_tiny_base.py ./tiny-gpt2-base --style gpt2    # GPT-2: Conv1D, gelu_new

The tokenizer is a byte-level BPE trained on a slice of the Python standard library's sources
(the built-in corpus), with Llama 3's special tokens: ``<|begin_of_text|>`` added to every
document by its post-processor, ``<|end_of_text|>`` as the end-of-sequence token. The model's
vocabulary has more rows than the tokenizer has ids, as real bases do (GPT-2: one row per id). The weights are saved
with ``save_pretrained`` in safetensors, sharded above ``--max-shard-size``.
"""

from __future__ import annotations

import argparse
import glob
import os
import sysconfig

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def train_tokenizer(vocab_size: int, num_files: int = 20):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:num_files]
    tok.train(files, trainer=trainer)
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)]
    )
    return tok


def hf_config(style: str, vocab_rows: int, bos: int, eos: int):
    import transformers

    common = dict(
        vocab_size=vocab_rows,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=bos,
        eos_token_id=eos,
    )
    if style == "llama":  # Llama 3.2: GQA, llama3 RoPE scaling, tied embeddings
        return transformers.LlamaConfig(
            **common,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if style == "gpt2":
        return transformers.GPT2Config(
            vocab_size=vocab_rows, n_embd=64, n_layer=2, n_head=4, n_positions=256, bos_token_id=bos, eos_token_id=eos
        )
    if style == "qwen2":
        return transformers.Qwen2Config(**common, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=1e6)
    return transformers.MistralConfig(**common, rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None)


def make_base(folder: str, style: str = "llama", vocab_size: int = 500, seed: int = 0, max_shard_size="100KB"):
    """Write the tiny base into `folder`; returns the folder."""
    import torch
    import transformers

    tok = train_tokenizer(vocab_size)
    rows = tok.get_vocab_size() if style == "gpt2" else -(-tok.get_vocab_size() // 64) * 64 + 64
    cfg = hf_config(style, rows, tok.token_to_id(BOS), tok.token_to_id(EOS))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # norms and biases away from their init, so a mix-up shows
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".bias", "ln_1.weight", "ln_2.weight", "ln_f.weight")):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder, max_shard_size=max_shard_size, safe_serialization=True)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS)
    fast.model_max_length = cfg.max_position_embeddings
    fast.save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder")
    p.add_argument("--style", choices=["llama", "qwen2", "mistral", "gpt2"], default="llama")
    p.add_argument("--vocab-size", type=int, default=500, help="the tokenizer's ids")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-shard-size", default="100KB", help="save_pretrained's shard size")
    args = p.parse_args(argv)
    make_base(args.folder, args.style, args.vocab_size, args.seed, args.max_shard_size)
    print(f"tiny {args.style} base written to {args.folder}: {sorted(os.listdir(args.folder))}")


if __name__ == "__main__":
    main()
