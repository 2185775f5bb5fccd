"""Export a committed checkpoint as a Hugging Face GPT-2 folder: ``python -m stoker.training.export``.

    python -m stoker.training.export <root>/runs/<run>/checkpoints/step-00000500 ./gpt2-out

writes ``model.safetensors`` and ``config.json`` that ``transformers.GPT2LMHeadModel`` loads,
plus the run's tokenizer (``tokenizer.json``, ``tokenizer_config.json``), and prints an
Exported event (a failure: a Failure event). It runs in a process of its own (the
orchestrator's rooms never import torch); ``tasks.export`` starts it for ``stoker export``.

The checkpoint is read the way every rank reads one: named checks first (commit manifest,
listed files, the manifest names this run and this model), then ``rehydrate``'s full
sha256 check, then only the model's tensors through ``SafeReader`` (nothing is unpickled).

Our GPT is GPT-2's architecture with three differences the export makes exact:
- GELU is the exact (erf) one, ``F.gelu``; GPT-2's is the tanh approximation (``gelu_new``).
  The config says ``activation_function: "gelu"``, which transformers computes with ``F.gelu``.
- ``model.bias: false`` drops the biases of the Linear and LayerNorm layers; GPT-2 always has
  them, so they are exported as zeros (the same function).
- The embedding (and the tied output matrix) is padded to ``model.vocab_pad_multiple`` rows;
  only the tokenizer's ``vocab_size`` rows are exported. The padded rows are never a target and
  a row's logit depends on that row alone, so the logits of every real token are unchanged.
Linear weights are (out, in) and GPT-2's Conv1D weights are (in, out): they are transposed.
The output matrix is tied to the token embedding in both, so it is stored once.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import uuid

import torch

from stoker.core import events
from stoker.core.config import ModelConfig
from stoker.core.failures import ExportError
from stoker.storage.checkpoints import rehydrate
from stoker.storage.layout import TOKENIZER_FILE, run_file_key
from stoker.storage.runs import export_source
from stoker.storage.store import default_cache_dir
from stoker.training.checkpoint import load_checkpoint
from stoker.training.model import GPT, padded_vocab

WEIGHTS_FILE = "model.safetensors"
# the ModelConfig fields this export expresses in GPT-2's config; any other field is a feature
# GPT-2 lacks, and the export refuses the model rather than write something that computes otherwise
_GPT2_FIELDS = {"n_layer", "n_head", "n_embd", "block_size", "dropout", "bias", "vocab_pad_multiple"}
# (our name, GPT-2's name, transpose: a Linear weight becomes a Conv1D weight)
_BLOCK_PARAMS = [
    ("ln_1.weight", "ln_1.weight", False),
    ("ln_1.bias", "ln_1.bias", False),
    ("attn.c_attn.weight", "attn.c_attn.weight", True),
    ("attn.c_attn.bias", "attn.c_attn.bias", False),
    ("attn.c_proj.weight", "attn.c_proj.weight", True),
    ("attn.c_proj.bias", "attn.c_proj.bias", False),
    ("ln_2.weight", "ln_2.weight", False),
    ("ln_2.bias", "ln_2.bias", False),
    ("mlp.c_fc.weight", "mlp.c_fc.weight", True),
    ("mlp.c_fc.bias", "mlp.c_fc.bias", False),
    ("mlp.c_proj.weight", "mlp.c_proj.weight", True),
    ("mlp.c_proj.bias", "mlp.c_proj.bias", False),
]


def check_exportable(cfg: ModelConfig) -> None:
    """ExportError when the model has a feature GPT-2's config cannot express."""
    other = sorted(set(type(cfg).model_fields) - _GPT2_FIELDS)
    if other:
        raise ExportError(
            f"model.{', model.'.join(other)}: not part of GPT-2's architecture, so "
            "the model cannot be exported as GPT-2 (the export knows "
            f"{', '.join(sorted(_GPT2_FIELDS))})"
        )


def gpt2_config(model: GPT, eot_id: int | None) -> dict:
    """GPT-2's config.json for this model (transformers' GPT2Config fields)."""
    cfg = model.cfg
    check_exportable(cfg)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    eps = {m.eps for m in norms}
    assert len(eps) == 1, f"LayerNorms with different eps: {eps}"
    out = {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": model.vocab_size,
        "n_positions": cfg.block_size,
        "n_embd": cfg.n_embd,
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "n_inner": model.blocks[0].mlp.c_fc.out_features,
        "activation_function": "gelu",  # F.gelu, exact (erf): see the module docstring
        "layer_norm_epsilon": eps.pop(),
        "resid_pdrop": cfg.dropout,
        "embd_pdrop": cfg.dropout,
        "attn_pdrop": cfg.dropout,
        "initializer_range": 0.02,
        "scale_attn_weights": True,  # scaled_dot_product_attention's 1/sqrt(head size)
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "use_cache": True,
        "dtype": "float32",
    }
    out["bos_token_id"] = out["eos_token_id"] = eot_id  # None: no tokenizer (GPT-2's 50256 would be wrong)
    return out


def gpt2_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """GPT-2's tensors (GPT2LMHeadModel names) from our model; see the module docstring."""
    ours = {name: p.detach().float().cpu() for name, p in model.state_dict().items()}
    taken = {"lm_head.weight"}  # tied to wte: stored once, as wte

    def take(name: str, width: int = 0) -> torch.Tensor:
        taken.add(name)
        if name in ours:
            return ours[name]
        assert name.endswith(".bias") and not model.cfg.bias, f"the model has no {name}"
        return torch.zeros(width)  # model.bias: false: a zero bias is the same function

    C = model.cfg.n_embd
    out = {
        "transformer.wte.weight": take("wte.weight")[: model.vocab_size],  # (V, C), unpadded
        "transformer.wpe.weight": take("wpe.weight"),
    }
    for i, block in enumerate(model.blocks):
        for mine, theirs, transpose in _BLOCK_PARAMS:
            module = block.get_submodule(mine.rsplit(".", 1)[0])
            width = module.out_features if isinstance(module, torch.nn.Linear) else C
            t = take(f"blocks.{i}.{mine}", width)
            out[f"transformer.h.{i}.{theirs}"] = t.t() if transpose else t  # (out, in) -> (in, out)
    out["transformer.ln_f.weight"] = take("ln_f.weight")
    out["transformer.ln_f.bias"] = take("ln_f.bias", C)
    left = sorted(set(ours) - taken)
    assert not left, f"parameters the export does not map: {left}"
    return {k: v.contiguous() for k, v in out.items()}


def tokenizer_files(
    data: bytes, vocab_size: int, eot_token: str, block_size: int
) -> tuple[dict[str, bytes], int | None]:
    """tokenizer.json as the run stored it, plus the configs transformers' AutoTokenizer reads;
    and the end-of-text id."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(data.decode())
    if tok.get_vocab_size() != vocab_size:
        raise ExportError(
            f"the run's {TOKENIZER_FILE} has {tok.get_vocab_size()} ids and the model {vocab_size}: they are not a pair"
        )
    special = {"bos_token": eot_token, "eos_token": eot_token}  # byte-level BPE: no unknown token
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": block_size,
        "clean_up_tokenization_spaces": False,
        **special,
    }
    files = {
        TOKENIZER_FILE: data,
        "tokenizer_config.json": json.dumps(config, indent=2).encode(),
        "special_tokens_map.json": json.dumps(special, indent=2).encode(),
    }
    return files, tok.token_to_id(eot_token)


def export_checkpoint(
    checkpoint_url: str, folder: str, cache_dir: str, storage_options: dict | None = None
) -> events.Exported:
    """Write the checkpoint at checkpoint_url as a GPT-2 folder at `folder` (new or empty).
    Everything is written into a sibling temporary folder first, then renamed into place."""
    from safetensors.torch import save_file

    folder = os.path.abspath(folder)
    named = export_source(checkpoint_url, folder, storage_options)
    store, where, cfg = named.store, named.where, named.config
    check_exportable(cfg.model)
    vocab_size = int(named.shards["vocab_size"])
    local = rehydrate(
        store,
        where.key,
        cache_dir,  # the full sha256 check of every file
        expected={"run_name": where.run_name, "model_hash": cfg.model_hash()},
    )
    model = GPT(cfg.model, vocab_size, seed=None)  # every weight is loaded
    load_checkpoint(local, model=model)  # tensors only, through SafeReader
    model.eval()
    tokenizer_key = run_file_key(where.run_name, TOKENIZER_FILE)
    files: dict[str, bytes] = {}
    eot_id = None
    if store.exists(tokenizer_key):  # every run folder pinned by the flow has one
        files, eot_id = tokenizer_files(
            store.read_bytes(tokenizer_key), vocab_size, cfg.tokenizer.eot_token, cfg.model.block_size
        )
    hf_config = gpt2_config(model, eot_id)
    hf_config["stoker"] = {
        "checkpoint": store.url(where.key),
        "step": named.manifest.get("step"),
        "run_name": where.run_name,
        "model_hash": cfg.model_hash(),
        "padded_vocab_size": padded_vocab(vocab_size, cfg.model.vocab_pad_multiple),
    }
    files["config.json"] = json.dumps(hf_config, indent=2).encode()
    tensors = gpt2_state_dict(model)
    parent = os.path.dirname(folder)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(folder)}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        os.makedirs(tmp)
        save_file(tensors, os.path.join(tmp, WEIGHTS_FILE), metadata={"format": "pt"})
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(os.path.join(tmp, WEIGHTS_FILE), 0o666 & ~umask)  # safetensors writes it 0600
        for name, data in files.items():
            with open(os.path.join(tmp, name), "wb") as f:
                f.write(data)
        if os.path.isdir(folder):
            os.rmdir(folder)  # empty (checked above); fails if something appeared meanwhile
        os.rename(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return events.Exported(
        checkpoint=store.url(where.key),
        step=int(named.manifest.get("step", -1)),
        folder=folder,
        files=sorted([WEIGHTS_FILE, *files]),
        vocab_size=vocab_size,
        num_params=sum(t.numel() for t in tensors.values()),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Export a stoker checkpoint as a Hugging Face GPT-2 folder.")
    p.add_argument("checkpoint_uri", help="{root}/runs/{run}/checkpoints/step-NNNNNNNN")
    p.add_argument("folder", help="a new or empty local folder")
    p.add_argument("--cache-dir", default=default_cache_dir())
    args = p.parse_args(argv)
    options = json.loads(os.environ.get("STOKER_STORAGE_OPTIONS", "{}"))
    return events.report_outcome(lambda: export_checkpoint(args.checkpoint_uri, args.folder, args.cache_dir, options))


if __name__ == "__main__":
    sys.exit(main())
