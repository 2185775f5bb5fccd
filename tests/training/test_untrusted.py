"""Untrusted checkpoint files are refused, never run: DCP's .metadata is a pickle, and a
planted one must not execute on load."""

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from stoker.families.gpt2.config import GPT2Config
from stoker.families.gpt2.model import GPT
from stoker.training.checkpoint import load_checkpoint
from stoker.training.untrusted import SafeReader, UnsafeCheckpoint


class _Payload:
    """Unpickling this calls os.system: what an attacker would plant."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _model():
    return GPT(GPT2Config(n_layer=1, n_head=2, n_embd=16, block_size=8), 50, seed=0)


def test_a_pickle_payload_planted_as_checkpoint_metadata_is_refused_not_run(tmp_path):
    folder = tmp_path / "ckpt"
    model = _model()
    dcp.save(
        {f"model.{n}": p.detach() for n, p in model.named_parameters()},
        storage_writer=dcp.FileSystemWriter(str(folder)),
        no_dist=True,
    )
    marker = tmp_path / "pwned"
    with open(folder / ".metadata", "wb") as f:
        pickle.dump(_Payload(marker), f)
    with pytest.raises(UnsafeCheckpoint, match="posix.system|os.system"):
        load_checkpoint(str(folder), model=_model())
    assert not marker.exists()  # nothing ran


def test_real_checkpoint_metadata_passes_the_allowlist(tmp_path):
    model = _model()
    dcp.save(
        {f"model.{n}": p.detach() for n, p in model.named_parameters()},
        storage_writer=dcp.FileSystemWriter(str(tmp_path)),
        no_dist=True,
    )
    meta = SafeReader(str(tmp_path)).read_metadata()
    assert "model.wte.weight" in meta.state_dict_metadata
    fresh = GPT(GPT2Config(n_layer=1, n_head=2, n_embd=16, block_size=8), 50, seed=1)
    load_checkpoint(str(tmp_path), model=fresh)
    assert torch.equal(fresh.wte.weight, model.wte.weight)
