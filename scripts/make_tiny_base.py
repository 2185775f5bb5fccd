"""Make a tiny random Hugging Face base model, locally (no hub): what the tiny-llama-cpu recipe
starts from, and what the tests load.

    python scripts/make_tiny_base.py ./tiny-llama-base                # Llama-3.2-style
    python scripts/make_tiny_base.py ./tiny-qwen-base --style qwen2   # q/k/v bias, untied
    python scripts/make_tiny_base.py ./tiny-gpt2-base --style gpt2    # GPT-2: Conv1D, gelu_new
    python scripts/make_tiny_base.py ./tiny-chat-base --style chat    # SmolLM2-like, see below
    python scripts/make_tiny_base.py ./tiny-qwen3-base --style qwen3  # Qwen3: q/k norms, see below
    python scripts/make_tiny_base.py ./tiny-qwen3-moe-base --style qwen3-moe  # Qwen3-MoE: 8 experts
    python scripts/make_tiny_base.py ./tiny-mixtral-base --style mixtral      # Mixtral: 4 experts

The tokenizer is a byte-level BPE trained on a slice of the Python standard library's sources
(the built-in corpus), with Llama 3's special tokens: ``<|begin_of_text|>`` added to every
document by its post-processor, ``<|end_of_text|>`` as the end-of-sequence token. The model's
vocabulary has more rows than the tokenizer has ids, as real bases do (GPT-2: one row per id). The weights are saved
with ``save_pretrained`` in safetensors, sharded above ``--max-shard-size``.

``--style chat`` has a real chat base's quirks (SmolLM2's): its byte-level vocabulary lacks 21
byte values (13 that UTF-8 never holds, 8 control bytes), its eos is the chat end of turn
``<|im_end|>`` beside an ``<|endoftext|>``, it has no bos and many added tokens, and its shapes
are grouped-query attention (6/2 heads) with an explicit ``head_dim`` (24, not 96 / 6).
``--style qwen3`` is Qwen3-0.6B's kind (the tiny-qwen3-cpu recipe's base): q/k RMSNorm per head,
no q/k/v bias, an explicit ``head_dim`` (32, with 4 heads over a width of 64), tied embeddings,
with the chat style's tokenizer (Qwen3's post-trained models end a turn with ``<|im_end|>``,
have no bos and a byte-level vocabulary).
``--style qwen3-moe`` is Qwen3-30B-A3B's kind, tiny (the tiny-qwen3-moe-cpu recipe's base): Qwen3's
attention, 8 experts of 32 a sparse layer, top-2 renormalized (``norm_topk_prob``), layer 1 of 3
dense (``mlp_only_layers``), untied, the chat tokenizer. ``--style mixtral``: Mixtral's kind, every
layer 4 experts top-2, Llama's attention, the Llama tokenizer. Both are saved as transformers 5
saves them, one tensor per expert.
``--no-tokenizer-config`` leaves tokenizer_config.json out.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys
import sysconfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # stoker, run from anywhere

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
# the chat style (a SmolLM2-like base): its end of text, its chat turn tokens, the eos a chat
# model ships with (the end of a turn), and the many added tokens of a code-and-chat vocabulary
TEXT_END, TURN_START, TURN_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHAT_ADDED = [
    f"<{name}>"
    for name in (
        "repo_name reponame file_sep filename gh_stars issue_start issue_comment issue_closed jupyter_start "
        "jupyter_text jupyter_code jupyter_output jupyter_script empty_output"
    ).split()
]
# the bytes its byte-level vocabulary lacks: 13 that never occur in UTF-8 (0xC0, 0xC1,
# 0xF5-0xFF) and 8 control bytes that the training text never held, 21 in all as in SmolLM2's
CHAT_LACKING = [0xC0, 0xC1, *range(0xF5, 0x100), *range(0x00, 0x07), 0x7F]


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


def train_chat_tokenizer(vocab_size: int, num_files: int = 20):
    """A byte-level BPE as a chat base has it: digits split one by one, no bos (no
    post-processor), <|endoftext|> and the chat turn tokens as specials, many added tokens, and
    a byte alphabet without CHAT_LACKING."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    from stoker.arithmetic.token_bytes import _bytes_to_unicode

    byte_chars = _bytes_to_unicode()  # GPT-2's byte-level alphabet: byte -> its character
    lacking = {byte_chars[b] for b in CHAT_LACKING}
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[TEXT_END, TURN_START, TURN_END, *CHAT_ADDED],
        initial_alphabet=[c for c in alphabet if c not in lacking],
        show_progress=False,
    )
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))[:num_files]
    tok.train(files, trainer=trainer)
    found = [b for b in CHAT_LACKING if tok.token_to_id(byte_chars[b]) is not None]
    assert not found, f"the training text held bytes the chat vocabulary should lack: {found}"
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
    if style == "chat":  # SmolLM2-like: GQA 6/2, an explicit head_dim (24, not 96 / 6), tied, no bos
        return transformers.LlamaConfig(
            **{**common, "hidden_size": 96, "num_attention_heads": 6, "bos_token_id": None},
            head_dim=24,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            rope_theta=100000.0,
        )
    if style == "qwen3":  # Qwen3-0.6B's kind: q/k norms, head_dim 32 (not 64 / 4), tied, no bos
        return transformers.Qwen3Config(
            **{**common, "bos_token_id": None},
            head_dim=32,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )
    if style == "qwen3-moe":  # Qwen3-30B-A3B's kind, tiny: 8 experts top-2 renormalized, a dense layer among them
        return transformers.Qwen3MoeConfig(
            **{**common, "bos_token_id": None, "num_hidden_layers": 3, "intermediate_size": 96},
            head_dim=32,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
            router_aux_loss_coef=0.001,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )
    if style == "mixtral":  # Mixtral's kind, tiny: every layer 4 experts top-2, Llama attention, untied
        return transformers.MixtralConfig(
            **{**common, "intermediate_size": 32},
            num_local_experts=4,
            num_experts_per_tok=2,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            router_aux_loss_coef=0.02,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        )
    if style == "qwen2":
        return transformers.Qwen2Config(**common, rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=1e6)
    return transformers.MistralConfig(**common, rms_norm_eps=1e-5, tie_word_embeddings=False, sliding_window=None)


def make_base(
    folder: str,
    style: str = "llama",
    vocab_size: int = 500,
    seed: int = 0,
    max_shard_size="100KB",
    tokenizer_config: bool = True,
):
    """Write the tiny base into `folder`; returns the folder. tokenizer_config=False: leave
    tokenizer_config.json out (the eos is then config.json's eos_token_id)."""
    import torch
    import transformers

    chat = style in ("chat", "qwen3", "qwen3-moe")  # the chat tokenizer's quirks
    tok = train_chat_tokenizer(vocab_size) if chat else train_tokenizer(vocab_size)
    rows = tok.get_vocab_size() if style == "gpt2" else -(-tok.get_vocab_size() // 64) * 64 + 64
    bos, eos = (None, TURN_END) if chat else (BOS, EOS)
    cfg = hf_config(style, rows, tok.token_to_id(bos) if bos else None, tok.token_to_id(eos))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # norms and biases away from their init, so a mix-up shows
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", ".bias", "ln_1.weight", "ln_2.weight", "ln_f.weight")):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder, max_shard_size=max_shard_size, safe_serialization=True)
    if chat:
        fast = transformers.PreTrainedTokenizerFast(
            tokenizer_object=tok, eos_token=TURN_END, pad_token=TEXT_END, additional_special_tokens=CHAT_ADDED
        )
    else:
        fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS)
    fast.model_max_length = cfg.max_position_embeddings
    fast.save_pretrained(folder)
    if not tokenizer_config:  # a base that ships tokenizer.json alone (its eos from config.json)
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            if os.path.exists(os.path.join(folder, name)):
                os.remove(os.path.join(folder, name))
    return folder


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder")
    p.add_argument(
        "--style",
        choices=["llama", "qwen2", "mistral", "gpt2", "chat", "qwen3", "qwen3-moe", "mixtral"],
        default="llama",
    )
    p.add_argument("--vocab-size", type=int, default=500, help="the tokenizer's ids")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-shard-size", default="100KB", help="save_pretrained's shard size")
    p.add_argument("--no-tokenizer-config", action="store_true", help="write tokenizer.json alone")
    args = p.parse_args(argv)
    make_base(args.folder, args.style, args.vocab_size, args.seed, args.max_shard_size, not args.no_tokenizer_config)
    print(f"tiny {args.style} base written to {args.folder}: {sorted(os.listdir(args.folder))}")


if __name__ == "__main__":
    main()
