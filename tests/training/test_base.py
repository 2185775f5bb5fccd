"""A run that starts from a base model (model.init_from), with real gloo ranks: the base's
weights only while the run has no valid checkpoint, read slice by slice under FSDP2; resume
owns the weights after the first commit (the base may be gone); a crash before the first
commit restarts from the base. (The same through the whole flow, a killed rank and the export
included: tests/flows/test_base_e2e.py.)

One module run (`based`: 2 FSDP2 ranks, 8 steps, checkpoints at 4 and 8, a sharded Qwen2-style
base made by scripts/make_tiny_base.py, q/k/v biases and untied embeddings, on short documents)
serves every test here; a Mistral-style base is taken through the same path, export and reload
included, by a run of its own."""

import json
import os
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

from stoker.config import load_config
from stoker.storage.bases import resolve_base
from stoker.storage.checkpoints import list_checkpoints
from stoker.storage.runs import pin_run_folder
from tests.bases import (
    documents,
    exported_logits_are_ours,
    loss_of_documents_alone,
    one_document,
    short_documents,
    tiny_base,
)
from tests.conftest import prepare_shards, tiny_dict, train_losses
from tests.forked_ranks import run_forked, start_ranks, train_argv


def _tensors(path):
    meta = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.items()}
    dcp.load(sd, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return sd


def _equal_states(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]) or (a[k].isnan().all() and b[k].isnan().all()), k


@pytest.fixture(scope="module")
def based(tmp_path_factory):
    """(cfg, store, shards, config URL, records, base folder) of the module's unbroken run."""
    base = shutil.copytree(tiny_base(tmp_path_factory, "qwen2"), tmp_path_factory.mktemp("based") / "base")
    root = "file://" + str(tmp_path_factory.mktemp("based-store") / "store")
    text = short_documents(tmp_path_factory.mktemp("based-text") / "text")
    sections = tiny_dict(root, run_name="based", engine={"parallelism": "fsdp"})
    sections["data"] = {"source": text, "val_fraction": 0.1}
    sections["model"] = {"family": "llama", "init_from": str(base), "block_size": 32}  # the rest: the base's
    del sections["tokenizer"]  # the base's
    cfg = resolve_base(load_config(sections))
    store, shards = prepare_shards(cfg)
    url = pin_run_folder(store, cfg, shards)
    records = run_forked(url, shards.key, nproc=2)
    return cfg, store, shards, url, records, str(base)


def test_the_run_starts_from_its_base_with_its_tokenizer(based):
    cfg, store, shards, _, records, base = based
    [loaded] = [r for r in records if r["event"] == "base_loaded"]
    assert loaded["sha256"] == cfg.model.base_sha256
    # each rank read its own half of the base (FSDP2 shards), never the whole; together, all of it
    total = sum(os.path.getsize(os.path.join(base, n)) for n in os.listdir(base) if n.endswith(".safetensors"))
    assert len(loaded["bytes_read"]) == 2 and all(n < 0.6 * total for n in loaded["bytes_read"])
    assert 0.95 * total <= sum(loaded["bytes_read"]) <= total
    assert sorted(train_losses(records)) == list(range(1, 9))
    # every checkpoint names the base it started from, by content
    from stoker.storage.checkpoints import COMMIT_FILE

    manifest = store.read_json(f"runs/based/checkpoints/step-00000004/{COMMIT_FILE}")
    assert json.dumps(manifest).count(cfg.model.base_sha256) >= 1 and '"model_family": "llama"' in json.dumps(manifest)
    # the shards hold the base's ids: each document begun by its bos and ended by its eos
    manifest = store.read_json(f"{shards.key}/manifest.json")
    tokens = torch.from_numpy(
        __import__("numpy").fromfile(store.local_path(f"{shards.key}/{manifest['splits']['train'][0]}"), "<u2")
    ).long()
    bos, eos = 0, 1  # make_tiny_base's <|begin_of_text|>, <|end_of_text|>
    assert manifest["eot_id"] == eos and tokens[0] == bos
    ends = (tokens == eos).nonzero().flatten()
    assert len(ends) > 3 and all(tokens[int(e) + 1] == bos for e in ends[:-1])


def test_the_first_loss_is_the_base_models_own(based):
    """Step 1's loss is the base's loss on step 1's batch, its documents masked (model.attention
    'document', a base's default): transformers' loss of each document alone, within
    torch.testing.assert_close's fp32 defaults (measured: the same float, 6.340683937072754, on
    2 CPU cores). The run trained the base, not random weights. The control: the loss of plain
    causal attention over the packed window (documents not masked) is not close (measured 8.9e-4
    apart, ~300x the tolerance)."""
    from transformers import AutoModelForCausalLM

    from stoker.training.data import Batches, TokenStream, TrainWindows

    cfg, store, shards, _, records, base = based
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    stream = TokenStream(store.local_path(shards.key), "train")
    windows = TrainWindows.one(stream, 32, seed=cfg.train.seed, global_batch=cfg.train.global_batch_size)
    assert cfg.model.attention == "document"
    losses, unmasked, spans = [], [], 0
    for rank in (0, 1):
        batches = Batches(windows, micro_batch=2, rank=rank, accum=2, device=torch.device("cpu"), prefetch=False)
        for micro in range(2):
            x, y = batches.get(0, micro)
            losses.append(loss_of_documents_alone(hf, x, y, stream.eot_id))
            spans += sum(len(documents(row, stream.eot_id)) > 1 for row in x)
            with torch.no_grad():  # (B*T,) plain causal attention across the window's documents
                unmasked.append(
                    torch.nn.functional.cross_entropy(hf(x).logits.flatten(0, 1), y.flatten(), reduction="none")
                )
    assert spans >= 1  # a window of step 1 holds two documents: the masking is seen
    first = torch.tensor(train_losses(records)[1], dtype=torch.float32)
    torch.testing.assert_close(first, torch.cat(losses).mean())  # fp32: rtol 1.3e-6, atol 1e-5
    with pytest.raises(AssertionError):  # the control: without document masking it is another loss
        torch.testing.assert_close(first, torch.cat(unmasked).mean())


def test_resume_owns_the_weights_once_a_checkpoint_is_committed_even_with_the_base_gone(based, tmp_path):
    cfg, store, shards, url, records, base = based
    shutil.move(base, tmp_path / "moved")
    try:
        resumed = run_forked(url, shards.key, resume="runs/based/checkpoints/step-00000004", nproc=2)
    finally:
        shutil.move(tmp_path / "moved", base)
    assert not [r for r in resumed if r["event"] == "base_loaded"]
    whole = train_losses(records)
    assert all(loss == whole[step] for step, loss in train_losses(resumed).items())
    _equal_states(
        _tensors(store.local_path("runs/based/checkpoints/step-00000008")),
        _tensors(store.local_path("runs/based/checkpoints/step-00000008.a1")),
    )


def test_a_crash_before_the_first_checkpoint_restarts_from_the_base(based, tmp_path):
    """Rank 1 dies at step 2, before any commit. The restart round (TORCHELASTIC_RESTART_COUNT=1,
    as torchrun's agent gives it; its in-place restart itself is tested in
    test_torchrun_resume.py) finds no valid checkpoint and starts from the base again, never
    from random weights, and ends bit for bit where the unbroken run does."""
    cfg, store, shards, url, records, base = based
    other = cfg.model_copy(update={"run_name": "based-crash"})
    store.write_bytes("runs/based-crash/config.json", other.to_json().encode())
    crash_url = store.url("runs/based-crash/config.json")
    killed = start_ranks(train_argv(crash_url, shards.key), 2, env={"STOKER_FAULT": "kill:rank=1:step=2"})
    try:
        first = [line for line in killed.lines(240) if "STOKER_METRIC " in line]
        assert killed.returncode != 0
    finally:
        killed.close()
        killed.remove()
    assert any('"base_loaded"' in line for line in first) and not list_checkpoints(store, "based-crash")
    again = run_forked(crash_url, shards.key, env={"TORCHELASTIC_RESTART_COUNT": "1"})
    assert [r["event"] for r in again].count("base_loaded") == 1
    assert train_losses(again) == train_losses(records)
    _equal_states(
        _tensors(store.local_path("runs/based/checkpoints/step-00000008")),
        _tensors(store.local_path(list_checkpoints(store, "based-crash")[0].key)),
    )


def _load_on_rank(rank: int, world: int, init: str, config_json: str, folder: str, vocab: int, out: str) -> None:
    """One rank of the sharded load: an FSDP2 model built as the engine builds it (meta device,
    sharded, materialized), the base's slices read into it, the full state gathered to rank 0."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from stoker.config import RunConfig
    from stoker.training.base import load_base
    from stoker.training.engine import Engine, build_model

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        cfg = RunConfig.model_validate_json(config_json)
        engine = Engine.resolve(cfg, torch.device("cpu"))
        raw, _ = build_model(cfg, vocab, engine, world, init=False)  # as the trainer builds it for a base
        read = load_base(raw, cfg.model, folder)
        full = get_model_state_dict(raw, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save({"state": full, "read": read}, out)
    finally:
        dist.destroy_process_group()


def test_a_2_rank_fsdp2_load_equals_a_1_rank_load_tensor_for_tensor(based, tmp_path):
    import torch.multiprocessing as mp

    from stoker.families import build_model
    from stoker.training.base import load_base

    cfg, _, shards, _, _, base = based
    init = f"file://{tmp_path}/rendezvous"
    mp.start_processes(
        _load_on_rank,
        args=(2, init, cfg.to_json(), base, shards.vocab_size, str(tmp_path / "full.pt")),
        nprocs=2,
        start_method="spawn",
    )
    sharded = torch.load(tmp_path / "full.pt")
    whole = build_model(cfg.model, shards.vocab_size, seed=None)
    read = load_base(whole, cfg.model, base)
    assert 0 < sharded["read"] < 0.6 * read  # rank 0 read about half of what one rank alone reads
    ours = whole.state_dict()
    assert sharded["state"].keys() == ours.keys()
    for name, t in ours.items():
        assert torch.equal(sharded["state"][name], t), name


def test_a_gpt2_base_loads_with_transformers_logits(tmp_path_factory, tmp_path):
    """The gpt2 family from a GPT-2 base (Conv1D weights read column-wise, gelu_new as
    'gelu_tanh', the base's longer position table cut to block_size): transformers' logits."""
    from transformers import AutoModelForCausalLM

    from stoker.config import build_config
    from stoker.families import build_model
    from stoker.training.base import load_base

    base = tiny_base(tmp_path_factory, "gpt2")
    cfg = resolve_base(
        build_config(
            None, **{"storage.root": f"file://{tmp_path}/store", "model.init_from": base, "model.block_size": 32}
        )
    )
    assert (cfg.model.family, cfg.model.activation, cfg.model.bias, cfg.model.vocab_pad_multiple) == (
        "gpt2",
        "gelu_tanh",
        True,
        1,
    )
    vocab = cfg.tokenizer.vocab_size
    ours = build_model(cfg.model, vocab, seed=None)
    load_base(ours, cfg.model, base)
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    ids = one_document(ours, cfg, torch.randint(0, vocab, (2, 32), generator=torch.Generator().manual_seed(0)))
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(ids)[0], hf(ids).logits)


@pytest.mark.parametrize("style", ["qwen2", "mistral"])
def test_a_qwen2_and_a_mistral_base_train_on_2_ranks_export_and_reload(based, style, tmp_path, tmp_path_factory):
    """The whole path of each: resolved from its files, 2 FSDP2 ranks, exported, reloaded by
    transformers with our logits. Qwen2: the module's run; Mistral: a 4-step run of its own."""
    if style == "qwen2":
        cfg, store, shards, _, _, _ = based
        key = "runs/based/checkpoints/step-00000008"
    else:
        base = shutil.copytree(tiny_base(tmp_path_factory, "mistral"), tmp_path / "base")
        sections = tiny_dict("file://" + str(tmp_path / "store"), run_name="mistral", engine={"parallelism": "fsdp"})
        sections["data"] = {"source": short_documents(tmp_path / "text"), "val_fraction": 0.1}
        sections["model"] = {"family": "llama", "init_from": str(base), "block_size": 32}
        sections["train"].update(max_steps=4)
        del sections["tokenizer"]
        cfg = resolve_base(load_config(sections))
        assert (cfg.model.qkv_bias, cfg.model.tie_embeddings) == (False, False)
        store, shards = prepare_shards(cfg)
        run_forked(pin_run_folder(store, cfg, shards), shards.key, nproc=2)
        key = "runs/mistral/checkpoints/step-00000004"
    exported = exported_logits_are_ours(cfg, store, key, shards.vocab_size, tmp_path / "hf")
    assert exported["model_type"] == {"qwen2": "qwen2", "mistral": "llama"}[style]
    assert exported["tie_word_embeddings"] is False
