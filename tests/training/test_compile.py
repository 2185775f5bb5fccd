"""What the compiler sees of stoker's model (issue 25), on the CPU with a counting backend:
torch.compile's real front end (dynamo, AOT autograd and its partitioner), with graphs run as
traced instead of through inductor's code generation, so each build takes a second or two.

- Under FSDP2 the activation checkpoint is inside each compiled block (torchtitan's order:
  checkpoint, compile, fully_shard): a step runs each compiled forward once in every
  checkpointing mode; the recomputation is inside the compiled backward.
- Under FSDP2 the output layer and the cross-entropy are compiled too.
- Alone (torchrun --nproc-per-node=1) there is no DDP wrapper: one compiled graph.
"""

from __future__ import annotations

import socket
from collections import Counter

import pytest
import torch
import torch.distributed as dist

from tests.conftest import tiny_dict


class CountingBackend:
    """A torch.compile backend that counts the graphs dynamo makes, the calls of their
    compiled forwards, and which graphs hold the cross-entropy."""

    def __init__(self):
        from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
        from torch._dynamo.backends.common import aot_autograd

        self.graphs, self.calls = [], Counter()

        def forward_compiler(gm, _inputs):
            def run(*args):
                self.calls["forward"] += 1
                return gm(*args)

            return make_boxed_func(run)

        # inductor's partitioner: it decides what the backward recomputes
        self.aot = aot_autograd(
            fw_compiler=forward_compiler,
            bw_compiler=lambda gm, _inputs: make_boxed_func(gm.forward),
            partition_fn=min_cut_rematerialization_partition,
        )

    def __call__(self, gm, example_inputs):
        self.graphs.append(gm)
        return self.aot(gm, example_inputs)

    def compiled_ops(self) -> set[str]:
        return {str(n.target) for g in self.graphs for n in g.graph.nodes if n.op == "call_function"}


@pytest.fixture
def alone_in_a_group():
    """A gloo process group of one rank, in this process (as torchrun --nproc-per-node=1 makes)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def _build(monkeypatch, backend: CountingBackend, **engine):
    import stoker.training.engine as engine_module
    from stoker.config import load_config

    torch._dynamo.reset()
    monkeypatch.setattr(engine_module, "compile_options", lambda tuning: {"backend": backend})
    cfg = load_config(
        tiny_dict(
            "file:///tmp/unused",
            engine={"compile": "on", **engine},
            model={"n_layer": 2, "n_head": 2, "n_embd": 128, "block_size": 32},
        )
    )
    e = engine_module.Engine.resolve(cfg, torch.device("cpu"))
    return engine_module.build_model(cfg, 384, e, world_size=1)


def _forward_calls_of_a_step(model, backend: CountingBackend) -> int:
    x = torch.randint(0, 384, (2, 32), generator=torch.Generator().manual_seed(0))
    for _ in range(2):  # the first compiles; the second is counted
        backend.calls.clear()
        _, loss = model(x, x)
        loss.backward()
    return backend.calls["forward"]


def test_fsdp2_runs_each_compiled_forward_once_a_step_in_every_checkpointing_mode(alone_in_a_group, monkeypatch):
    """Before: the checkpoint wrapped the compiled block from outside, so its recomputation ran
    the whole compiled forward again (2 blocks: 2 calls a step without checkpointing, 4 with
    'selective' or 'full'), and the selective policy never saw the matmuls it should keep."""
    calls = {}
    for mode in ("none", "selective", "full"):
        backend = CountingBackend()
        _, model = _build(monkeypatch, backend, parallelism="fsdp", activation_checkpointing=mode)
        calls[mode] = _forward_calls_of_a_step(model, backend)
    # 2 blocks and the output layer with its loss, once each, whatever is recomputed
    assert calls == {"none": 3, "selective": 3, "full": 3}, calls


def test_fsdp2_compiles_the_output_layer_and_cross_entropy(alone_in_a_group, monkeypatch):
    """Before: only the blocks were compiled under FSDP2; the vocabulary-wide matmul and the
    cross-entropy ran eagerly."""
    backend = CountingBackend()
    _, model = _build(monkeypatch, backend, parallelism="fsdp")
    _forward_calls_of_a_step(model, backend)
    assert any("cross_entropy" in op for op in backend.compiled_ops()), backend.compiled_ops()


def test_one_rank_in_a_process_group_trains_one_compiled_graph_without_ddp(alone_in_a_group, monkeypatch):
    """torchrun --nproc-per-node=1: nothing to all-reduce, so no DDP wrapper, whose graph
    splitting at its gradient buckets cut this model's compiled forward in two (GPT-2 124M on
    the CPU: 14 graphs)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    backend = CountingBackend()
    raw, model = _build(monkeypatch, backend)
    assert not isinstance(model, DDP)
    assert _forward_calls_of_a_step(model, backend) == 1
    assert len(backend.graphs) == 1, [g.graph for g in backend.graphs]
    assert raw.wte.weight.grad is not None  # the step trains the raw module the optimizer holds


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_process_group_gets_the_configured_collective_timeout(monkeypatch):
    """Before: no timeout was given (NCCL's default is 10 minutes, which a slow checkpoint
    download on one host can exceed while the others wait)."""
    from stoker.config import load_config
    from stoker.training.distributed import setup_distributed

    for name, value in {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(_free_port()),
        "WORLD_SIZE": "1",
        "RANK": "0",
        "LOCAL_RANK": "0",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    cfg = load_config(tiny_dict("file:///tmp/unused", launch={"collective_timeout_seconds": 77, "backend": "gloo"}))
    setup_distributed(cfg)
    try:
        backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
        assert backend.options._timeout.total_seconds() == 77
    finally:
        dist.destroy_process_group()


def test_a_too_short_collective_timeout_is_one_clear_error():
    from stoker.config import load_config
    from stoker.failures import ConfigError

    with pytest.raises(ConfigError, match=r"launch.collective_timeout_seconds.*1800"):
        load_config(tiny_dict("file:///tmp/unused", launch={"collective_timeout_seconds": 5}))


def test_deterministic_auto_is_on_for_cpu_ranks_and_off_on_cuda():
    """train.deterministic 'auto' (the default): bitwise resume on CPUs, speed on GPUs; true
    and false mean always."""
    from stoker.config import load_config
    from stoker.training.engine import deterministic_enabled

    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    auto = load_config(tiny_dict("file:///tmp/unused"))
    assert auto.train.deterministic == "auto"
    assert (deterministic_enabled(auto, cpu), deterministic_enabled(auto, cuda)) == (True, False)
    for value in (True, False):
        cfg = load_config(tiny_dict("file:///tmp/unused", train={"deterministic": value}))
        assert deterministic_enabled(cfg, cpu) is value and deterministic_enabled(cfg, cuda) is value


def test_fsdp_needs_the_torch_whose_sharded_init_it_uses():
    """FSDP2's init fills each rank's shard with distribute_tensor(src_data_rank=None), which
    torch 2.7 added: torch 2.6 is refused before a launch, naming the field and the fix."""
    from stoker.config import EngineConfig

    fsdp = EngineConfig(parallelism="fsdp")
    (problem,) = fsdp.torch_problems("2.6.0+cu124")
    assert "engine.parallelism" in problem and "torch 2.7 or newer" in problem and "'ddp'" in problem
    assert fsdp.torch_problems("2.7.1") == [] and fsdp.torch_problems(torch.__version__) == []


@pytest.mark.parametrize(
    "name, tflops",
    [
        ("NVIDIA H100 80GB HBM3", 989),
        ("NVIDIA H100 PCIe", 756),
        ("NVIDIA H100 NVL", 835),
        ("NVIDIA H200", 989),
        ("NVIDIA H200 NVL", 835),
        ("NVIDIA H800", 989),
        ("NVIDIA H800 PCIe", 756),
        ("NVIDIA GH200 480GB", 989),
        ("NVIDIA A100-SXM4-80GB", 312),
    ],
)
def test_peak_flops_of_each_hopper_board(name, tflops):
    """Before: H200 NVL and H800 PCIe got the SXM figure (989), overstating their MFU's
    denominator by 18% and 31%."""
    from stoker.training.engine import peak_flops_of

    assert peak_flops_of(name) == tflops * 1e12
