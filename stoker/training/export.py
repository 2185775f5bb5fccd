"""Export a committed checkpoint as a Hugging Face folder: ``python -m stoker.training.export``.

    python -m stoker.training.export <root>/runs/<run>/checkpoints/step-00000500 ./hf-out

writes ``config.json`` with the family's ``architectures`` (GPT2LMHeadModel, LlamaForCausalLM,
Qwen2ForCausalLM, Qwen3ForCausalLM), the weights as safetensors (``model.safetensors``, or shards with
``model.safetensors.index.json`` above ``--max-shard-bytes``), and the run's tokenizer (a
base's own tokenizer files where the run started from one), which ``AutoModelForCausalLM``
and ``AutoTokenizer`` load; and prints an Exported event (a failure: a Failure event). It
runs in a process of its own (the orchestrator's rooms never import torch); ``launch.export``
starts it for ``stoker export``.

The checkpoint is read the way every rank reads one: named checks first (commit manifest,
listed files, the manifest names this run and this model), then ``rehydrate``'s full
sha256 check, then only the model's tensors through ``SafeReader`` (nothing is unpickled).
The tensors go through the family's adapter (``ModelSpec.to_hf``: names, transposes, GPT-2's
zero biases under ``model.bias: false``, padded vocabulary rows cut to the tokenizer's).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import uuid

import torch

from stoker.contracts import events
from stoker.failures import ExportError
from stoker.families import build_model, spec_of
from stoker.families.spec import hf_rows
from stoker.process.quick_exit import quick_exit
from stoker.storage.branches import lineage_chain
from stoker.storage.checkpoints import rehydrate
from stoker.storage.layout import BASE_DIR, TOKENIZER_FILE, run_file_key
from stoker.storage.runs import export_source
from stoker.storage.store import default_cache_dir
from stoker.training.checkpoint import load_checkpoint

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 2**30  # transformers' default max_shard_size ("5GB")
# a base's tokenizer files (pinned in the run folder's base/ by the flow), exported as they are
BASE_TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


def hf_config(model_cfg, vocab_size: int, bos_id: int | None, eos_id: int | None) -> dict:
    """The Hugging Face config.json of a model of this config (the family's adapter), with the
    tokenizer's special ids."""
    out = model_cfg.to_hf_config(hf_rows(model_cfg, vocab_size))
    out.update(bos_token_id=bos_id, eos_token_id=eos_id, dtype="float32")
    return out


def hf_state_dict(model: torch.nn.Module, model_cfg, vocab_size: int) -> dict[str, torch.Tensor]:
    """The model's tensors under Hugging Face's names and layout, fp32 on the host."""
    state = {name: t.detach().float().cpu() for name, t in model.state_dict().items()}
    return spec_of(model_cfg).to_hf(model_cfg, state, vocab_size)


def shard_tensors(tensors: dict[str, torch.Tensor], max_bytes: int) -> dict[str, dict[str, torch.Tensor]]:
    """{file name: tensors}: one model.safetensors, or model-0000i-of-0000n.safetensors of at
    most max_bytes each (a bigger tensor alone in its file), in the tensors' order."""
    groups: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > max_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = t
        size += nbytes
    if len(groups) == 1:
        return {WEIGHTS_FILE: groups[0]}
    n = len(groups)
    return {f"model-{i + 1:05d}-of-{n:05d}.safetensors": g for i, g in enumerate(groups)}


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
    special = {"bos_token": eot_token, "eos_token": eot_token}  # a trained byte-level BPE: no unknown token
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
    checkpoint_url: str,
    folder: str,
    cache_dir: str,
    storage_options: dict | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> events.Exported:
    """Write the checkpoint at checkpoint_url as a Hugging Face folder at `folder` (new or
    empty). Everything is written into a sibling temporary folder first, then renamed into place."""
    from safetensors.torch import save_file

    folder = os.path.abspath(folder)
    named = export_source(checkpoint_url, folder, storage_options)
    store, where, cfg = named.store, named.where, named.config
    vocab_size = int(named.shards["vocab_size"])
    local = rehydrate(
        store,
        where.key,
        cache_dir,  # the full sha256 check of every file
        expected={"run_name": where.run_name, "model_hash": cfg.model_hash()},
    )
    model = build_model(cfg.model, vocab_size, seed=None)  # every weight is loaded
    load_checkpoint(local, model=model)  # tensors only, through SafeReader
    model.eval()
    files, bos_id, eos_id = _tokenizer_of_run(store, where.run_name, cfg, vocab_size)
    config = hf_config(cfg.model, vocab_size, bos_id, eos_id)
    config["stoker"] = {
        "checkpoint": store.url(where.key),
        "step": named.manifest.get("step"),
        "run_name": where.run_name,
        "model_hash": cfg.model_hash(),
        "base": cfg.model.init_from,
        "base_sha256": cfg.model.base_sha256,
        "padded_vocab_size": spec_of(cfg.model).vocab_rows(cfg.model, vocab_size),
        # a branch's ancestry, nearest first: each run's parent, step and checkpoint (its sha256)
        "lineage": lineage_chain(store, where.run_name),
    }
    files["config.json"] = json.dumps(config, indent=2).encode()
    tensors = hf_state_dict(model, cfg.model, vocab_size)
    shards = shard_tensors(tensors, max_shard_bytes)
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map = {name: file for file, group in shards.items() for name in group}
        files[INDEX_FILE] = json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2).encode()
    parent = os.path.dirname(folder)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(folder)}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        os.makedirs(tmp)
        umask = os.umask(0)
        os.umask(umask)
        for file, group in shards.items():
            save_file(group, os.path.join(tmp, file), metadata={"format": "pt"})
            os.chmod(os.path.join(tmp, file), 0o666 & ~umask)  # safetensors writes it 0600
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
        files=sorted([*shards, *files]),
        vocab_size=vocab_size,
        num_params=sum(t.numel() for t in tensors.values()),
    )


def _tokenizer_of_run(store, run: str, cfg, vocab_size: int) -> tuple[dict[str, bytes], int | None, int | None]:
    """(tokenizer files, bos id, eos id) of a run: a base's own files and ids as the base has
    them (pinned in the run folder's base/), else the trained tokenizer with the configs
    transformers reads, its end-of-text as both."""
    tokenizer_key = run_file_key(run, TOKENIZER_FILE)
    if not store.exists(tokenizer_key):  # every run folder pinned by the flow has one
        return {}, None, None
    data = store.read_bytes(tokenizer_key)
    if not cfg.model.init_from:
        files, eot_id = tokenizer_files(data, vocab_size, cfg.tokenizer.eot_token, cfg.model.block_size)
        return files, eot_id, eot_id
    files = {TOKENIZER_FILE: data}
    for name in BASE_TOKENIZER_FILES:
        key = run_file_key(run, f"{BASE_DIR}/{name}")
        if store.exists(key):
            files[name] = store.read_bytes(key)
    base_config = store.read_json(run_file_key(run, f"{BASE_DIR}/config.json"))
    return files, base_config.get("bos_token_id"), base_config.get("eos_token_id")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Export a stoker checkpoint as a Hugging Face folder.")
    p.add_argument("checkpoint_uri", help="{root}/runs/{run}/checkpoints/step-NNNNNNNN")
    p.add_argument("folder", help="a new or empty local folder")
    p.add_argument("--cache-dir", default=default_cache_dir())
    p.add_argument("--max-shard-bytes", type=int, default=MAX_SHARD_BYTES, help="split the weights above this size")
    args = p.parse_args(argv)
    options = json.loads(os.environ.get("STOKER_STORAGE_OPTIONS", "{}"))
    return events.report_outcome(
        lambda: export_checkpoint(args.checkpoint_uri, args.folder, args.cache_dir, options, args.max_shard_bytes)
    )


if __name__ == "__main__":
    quick_exit(main())
