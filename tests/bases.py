"""Tiny random Hugging Face base models for the tests, made locally by the repo's own script
(scripts/make_tiny_base.py: transformers' save_pretrained, a tokenizer trained here; never the
Hub). One of each style per pytest worker: `tiny_base(tmp_path_factory, "llama")`."""

from __future__ import annotations

import importlib.util
import os
import shutil

from tests.conftest import ROOT

_MADE: dict[tuple, str] = {}


def _script():
    spec = importlib.util.spec_from_file_location("make_tiny_base", os.path.join(ROOT, "scripts", "make_tiny_base.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_base(tmp_path_factory, style: str = "llama", seed: int = 0, max_shard_size: str = "100KB") -> str:
    """The folder of a tiny base of `style` (sharded into several safetensors files at the
    default size), made once per worker; callers that change it copy it first (`copy_base`)."""
    key = (style, seed, max_shard_size)
    if key not in _MADE or not os.path.isdir(_MADE[key]):
        folder = str(tmp_path_factory.mktemp(f"base-{style}-{seed}") / "base")
        _script().make_base(folder, style=style, seed=seed, max_shard_size=max_shard_size)
        _MADE[key] = folder
    return _MADE[key]


def copy_base(folder: str, dest) -> str:
    dest = str(dest)
    shutil.copytree(folder, dest)
    return dest


def one_document(model, cfg, ids):
    """A run from a base masks attention per document (model.attention 'document'): the model
    gets its separator id (the base's end-of-text, as the shards have it), and `ids` are made one
    document (no separator inside), where masked attention is transformers' causal attention."""
    import os

    from tokenizers import Tokenizer

    path = cfg.tokenizer.path.removeprefix("file://")
    end = Tokenizer.from_file(path if os.path.isfile(path) else cfg.tokenizer.path).token_to_id(cfg.tokenizer.eot_token)
    model.document_end_id = end
    ids = ids.clone()
    ids[ids == end] = end - 1 if end > 0 else end + 1
    return ids


def documents(row, end_id: int) -> list[tuple[int, int]]:
    """[start, end) of each document of a packed window (its separator, end_id, ends it)."""
    ends = [i + 1 for i, t in enumerate(row.tolist()) if t == end_id]
    starts = [0] + ends
    return [(s, e) for s, e in zip(starts, ends + [len(row)]) if e > s]


def loss_of_documents_alone(hf, x, y, end_id: int):
    """(B,) each window's mean loss by transformers' `hf`, each document of it scored alone (what
    model.attention 'document' computes on the packed window, for a RoPE family)."""
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        return torch.stack(
            [
                F.cross_entropy(torch.cat([hf(x[b : b + 1, s:e]).logits[0] for s, e in documents(x[b], end_id)]), y[b])
                for b in range(len(x))
            ]
        )


_WORDS = (
    "the court held that each party to the agreement shall indemnify the other against any claim arising "
    "under section of this contract notwithstanding clause liability damages plaintiff appeal statute"
).split()


def short_documents(folder, count: int = 200) -> str:
    """A folder of `count` short filings of legal-sounding text, each shorter than a training
    window, so that packed windows span documents (made here, never downloaded)."""
    import random

    rng = random.Random(0)
    folder.mkdir(exist_ok=True)
    for i in range(count):
        paragraphs = [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 12))) for _ in range(rng.randint(1, 2))]
        (folder / f"filing-{i:03d}.txt").write_text(f"Filing {i}.\n" + ".\n".join(paragraphs) + ".\n")
    return str(folder)


def exported_tensors_are_the_checkpoints(model_cfg, checkpoint_dir: str, folder) -> None:
    """Every tensor in an exported folder's safetensors equals (torch.equal) the checkpoint's
    own tensor named for it by the family's name map (``ModelSpec.hf_map``), read from the
    checkpoint with torch's DCP reader (not the export's path); the vocabulary's padded rows,
    beyond config.json's ``vocab_size``, are the only thing left out."""
    import glob
    import json
    import os

    import torch
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    from stoker.families import spec_of
    from stoker.families.spec import is_vocab

    reader = dcp.FileSystemReader(checkpoint_dir)
    meta = reader.read_metadata().state_dict_metadata
    saved = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.items() if k.startswith("model.")}
    dcp.load(saved, storage_reader=reader, no_dist=True)
    exported = {}
    for path in sorted(glob.glob(os.path.join(str(folder), "*.safetensors"))):
        exported.update(load_file(path))
    spec = spec_of(model_cfg)
    names = spec.hf_map(model_cfg)
    assert sorted(exported) == sorted(spec.hf_names(model_cfg))
    rows = json.loads(open(os.path.join(str(folder), "config.json")).read())["vocab_size"]
    for ours, theirs, transpose in names:
        t = saved["model." + ours]
        if isinstance(theirs, tuple):  # a mixture's stacked experts: one exported tensor each
            assert all(torch.equal(exported[name], t[e]) for e, name in enumerate(theirs)), ours
            continue
        t = t.t() if transpose else t
        if is_vocab(ours):
            t = t[:rows]
        assert torch.equal(exported[theirs], t), (ours, theirs)


def exported_logits_are_ours(cfg, store, checkpoint_key: str, vocab: int, folder) -> dict:
    """`stoker export` of a checkpoint: its safetensors are the checkpoint's tensors, tensor by
    tensor (`exported_tensors_are_the_checkpoints`), and, loaded by transformers'
    AutoModelForCausalLM, its logits on one document are our checkpoint's; returns the exported
    config.json."""
    import contextlib
    import io
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from stoker.cli import main
    from stoker.families import build_model
    from stoker.training.checkpoint import load_checkpoint

    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["export", store.url(checkpoint_key), str(folder)]) == 0
    exported_tensors_are_the_checkpoints(cfg.model, store.local_path(checkpoint_key), folder)
    hf = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    ours = build_model(cfg.model, vocab, seed=None)
    load_checkpoint(store.local_path(checkpoint_key), model=ours)
    ids = one_document(ours, cfg, torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(0)))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits[..., :vocab], ours.eval()(ids)[0])
    return json.loads((folder / "config.json").read_text())
