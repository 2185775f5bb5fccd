"""The preflight's check of document attention on CUDA (preflight.flex_attention_problem): a
head size or a torch that flex attention's fused kernel cannot take is one line naming the field
and the fix, before any compute; CPU ranks (the exact eager path) are never refused. The limits
are those torch's own sources raise (preflight.py names them); no GPU is needed to judge them."""

import pytest

from stoker import preflight
from stoker.config import build_config

NO_GPUS = {"CUDA_VISIBLE_DEVICES": ""}


@pytest.mark.parametrize(
    "head_dim, torch_version, block_size",
    [
        (64, "2.5.1+cu124", 1024),  # the first torch with flex attention, a power of two
        (128, "2.13.0+cu130", 8192),
        (16, "2.7.0", 64),  # the narrowest head the Triton kernel takes
        (48, "2.7.0+cu126", 512),  # any size from 2.7 (rounded up inside the kernel)
        (80, "2.10.0", 128),  # a window of 128 or more never reaches the decoding kernel
        (48, "2.11.0", 64),  # 2.11's decoding kernel rounds too
        (64, "none", 64),  # a torch that cannot be read is not judged
    ],
)
def test_a_head_size_flex_attention_takes_on_cuda_passes(head_dim, torch_version, block_size):
    assert preflight.flex_attention_problem(head_dim, torch_version, "cuda", block_size, "model.head_dim") is None


@pytest.mark.parametrize(
    "head_dim, torch_version, block_size, says",
    [
        (8, "2.13.0", 1024, "a head size of 8 is narrower than flex attention's fused kernel takes"),
        (48, "2.6.0+cu124", 1024, "not a power of two, which the ranks' torch 2.6.0+cu124 flex attention refuses"),
        (80, "2.5.1", 2048, "from torch 2.7"),
        (48, "2.10.0", 64, "sends torch 2.10.0's flex attention to its decoding kernel"),
        (64, "2.4.1", 1024, "torch 2.5 or newer) and the ranks have torch 2.4.1"),
    ],
)
def test_a_head_size_or_torch_flex_attention_cannot_take_on_cuda_is_one_line_with_the_fix(
    head_dim, torch_version, block_size, says
):
    line = preflight.flex_attention_problem(head_dim, torch_version, "cuda", block_size, "model.head_dim")
    assert line is not None and "\n" not in line and says in line, line
    assert line.startswith("model.attention: " if torch_version == "2.4.1" else "model.head_dim: "), line
    assert "set model.attention=causal" in line, line


@pytest.mark.parametrize("head_dim, torch_version", [(8, "2.13.0"), (48, "2.6.0"), (64, "2.4.1")])
def test_cpu_ranks_are_never_refused(head_dim, torch_version):
    assert preflight.flex_attention_problem(head_dim, torch_version, "cpu", 64, "model.head_dim") is None


def _narrow_heads(**over):
    """tiny-cpu's gpt2 with heads of 8 (128 / 16) under document attention."""
    return build_config("tiny-cpu", **{"model.n_head": 16, "model.attention": "document", **over})


def test_document_attention_with_heads_too_narrow_is_refused_where_the_ranks_run_on_cuda(monkeypatch):
    for name, value in NO_GPUS.items():
        monkeypatch.setenv(name, value)
    on_h100 = preflight.attention_problems(_narrow_heads(**{"launch.accelerator": "H100"}))
    assert len(on_h100) == 1 and on_h100[0].startswith("model.n_embd / model.n_head: a head size of 8 "), on_h100
    assert preflight.attention_problems(_narrow_heads(**{"launch.backend": "nccl"})) == on_h100
    # the ranks on CPUs: gloo, or no GPU named nor here; causal attention never runs flex attention
    assert preflight.attention_problems(_narrow_heads(**{"launch.accelerator": "H100", "launch.backend": "gloo"})) == []
    assert preflight.attention_problems(_narrow_heads()) == []
    assert (
        preflight.attention_problems(_narrow_heads(**{"launch.accelerator": "H100", "model.attention": "causal"})) == []
    )


def test_the_line_comes_with_the_others_from_the_one_preflight(tmp_path, monkeypatch):
    for name, value in NO_GPUS.items():
        monkeypatch.setenv(name, value)
    config = _narrow_heads(**{"launch.accelerator": "H100", "storage.root": f"file://{tmp_path}/store"})
    found = preflight.problems(config)
    assert any(line.startswith("model.n_embd / model.n_head: a head size of 8 ") for line in found), found
