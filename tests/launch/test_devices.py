"""GPU counting without torch, and the config-time device rules built on it."""

import pytest

from stoker.config import load_config
from stoker.launch.devices import device_problems, visible_gpu_count


@pytest.fixture
def driver(tmp_path):
    """A folder laid out as /proc/driver/nvidia/gpus is on a host with four GPUs."""
    for bus in ("0000:01:00.0", "0000:02:00.0", "0000:41:00.0", "0000:42:00.0"):
        (tmp_path / bus).mkdir()
    return str(tmp_path)


@pytest.mark.parametrize(
    "visible,expected",
    [(None, 4), ("0,1", 2), ("", 0), ("-1", 0), ("0,1,-1,3", 2), ("GPU-8f3e,GPU-11aa", 2), ("0,1,2,3,4,5", 4)],
)
def test_visible_gpus_are_the_drivers_narrowed_by_cuda_visible_devices(driver, visible, expected):
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    assert visible_gpu_count(env, proc=driver) == expected


def test_no_driver_is_no_gpu(tmp_path):
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "0,1"}, proc=str(tmp_path / "absent")) == 0


def test_device_rules_name_the_field_and_the_fix():
    gpu8 = load_config("gpt2-124m")
    [none] = device_problems(gpu8, gpus=0)
    assert none.startswith("launch.backend: 'nccl' needs NVIDIA GPUs") and "tiny-cpu" in none
    [few] = device_problems(gpu8, gpus=4)
    assert few.startswith("launch.nproc_per_node: 8 rank(s) on this host need a GPU each and it has 4")
    assert "at most 4" in few
    assert device_problems(gpu8, gpus=8) == []
    cpu = load_config("tiny-cpu")  # gloo or auto on CPUs: nothing needed
    assert device_problems(cpu, gpus=0) == []
    two_nodes = load_config(
        "tiny-cpu",
        **{"launch.num_nodes": 2, "launch.nproc_per_node": 2, "launch.backend": "auto", "train.global_batch_size": 16},
    )
    [shared] = device_problems(two_nodes, gpus=2)  # simulated nodes share this host's GPUs
    assert "4 rank(s) on this host" in shared and "at most 1" in shared


def test_nodes_on_other_machines_bring_their_own_gpus():
    """launch.nodes: only the nodes without a prefix run on this host, whose GPUs are checked."""

    def two_nodes(first: dict):
        return load_config(
            "gpt2-124m",
            **{
                "launch.num_nodes": 2,
                "train.global_batch_size": 384,
                "launch.rdzv_host": "10.0.0.10",
                "launch.rdzv_port": 29500,
                "launch.nodes": [first, {"prefix": ["ssh", "host1"], "address": "10.0.0.11"}],
            },
        )

    assert device_problems(two_nodes({"prefix": ["ssh", "host0"], "address": "10.0.0.10"}), gpus=0) == []
    [few] = device_problems(two_nodes({"address": "10.0.0.10"}), gpus=4)  # node 0 runs here
    assert few.startswith("launch.nproc_per_node: 8 rank(s) on this host need a GPU each and it has 4")


def test_engine_settings_that_cpu_ranks_cannot_honour_are_found_before_the_launch():
    """Ranks run on CPUs where the host has no GPU or launch.backend is gloo: fused AdamW
    ('on') and compile tuning under compile 'auto' (off on CPUs) are refused here, every
    problem at once, with the same words a rank would use; on GPUs they are fine."""
    import torch

    from stoker.failures import ConfigError
    from stoker.training.engine import Engine

    fused = load_config("tiny-cpu", **{"engine.fused_optimizer": "on", "engine.compile_tuning": "coordinate-descent"})
    problems = device_problems(fused, gpus=0)
    assert [p.split(":")[0] for p in problems] == ["engine.fused_optimizer", "engine.compile_tuning"]
    assert "use 'auto' or 'off'" in problems[0] and "set engine.compile to 'on'" in problems[1]
    with pytest.raises(ConfigError) as err:  # what a rank on a CPU says: the same lines
        Engine.resolve(fused, torch.device("cpu"))
    assert err.value.problems == problems
    # an evaluation of such a run's checkpoint on a CPU uses neither the optimizer nor compile
    assert not Engine.resolve(fused, torch.device("cpu"), training=False).bf16
    gloo_on_gpus = load_config("tiny-cpu", **{"engine.fused_optimizer": "on", "launch.backend": "gloo"})
    assert [p.split(":")[0] for p in device_problems(gloo_on_gpus, gpus=8)] == ["engine.fused_optimizer"]
    auto_on_gpus = load_config("tiny-cpu", **{"engine.fused_optimizer": "on", "launch.backend": "auto"})
    assert device_problems(auto_on_gpus, gpus=8) == []
    nccl = load_config("gpt2-124m", **{"engine.fused_optimizer": "on"})  # both, in one report
    assert [p.split(":")[0] for p in device_problems(nccl, gpus=0)] == ["launch.backend", "engine.fused_optimizer"]


def test_fsdp_with_a_torch_older_than_fsdp2_is_found_before_the_launch_and_by_the_ranks(monkeypatch):
    """FSDP2's public fully_shard came with torch 2.6, and its sharded init with 2.7 (the
    project accepts torch 2.4): with an older torch the host check says so in one line, from the package's metadata, and a rank
    would say the same; DDP, an evaluation and this machine's torch are fine."""
    import importlib.metadata

    import torch

    from stoker.failures import ConfigError
    from stoker.launch.devices import installed_torch
    from stoker.training.engine import Engine

    fsdp = load_config("tiny-cpu", **{"engine.parallelism": "fsdp"})
    problems = device_problems(fsdp, gpus=0, torch_version="2.6.0+cu124")
    assert problems == [
        "engine.parallelism: 'fsdp' needs torch 2.7 or newer (FSDP2's fully_shard and "
        "its sharded init) and the ranks have torch 2.6.0+cu124; upgrade torch, or "
        "use 'ddp'."
    ]
    assert device_problems(fsdp, gpus=0, torch_version="2.7.0") == []
    assert device_problems(fsdp, gpus=0, torch_version="2.10.1") == []  # 10 > 7, not "1" < "7"
    assert device_problems(load_config("tiny-cpu"), gpus=0, torch_version="2.4.0") == []  # ddp
    # the metadata has no local label where the wheel's torch.__version__ does (PyPI's 2.15.0 says
    # "2.15.0+cu132"); the CPU wheel's metadata keeps its "+cpu"
    assert installed_torch() == importlib.metadata.version("torch")
    assert installed_torch().split("+")[0] == torch.__version__.split("+")[0]
    assert device_problems(fsdp, gpus=0) == []  # this machine's torch (2.13 in CI)
    assert Engine.resolve(fsdp, torch.device("cpu")).fsdp  # this torch: FSDP2
    both = load_config("tiny-cpu", **{"engine.parallelism": "fsdp", "engine.fused_optimizer": "on"})
    problems = device_problems(both, gpus=0, torch_version="2.5.1+cu124")
    assert [p.split(":")[0] for p in problems] == ["engine.parallelism", "engine.fused_optimizer"]
    monkeypatch.setattr(torch, "__version__", "2.5.1+cu124")  # what a rank with that torch says
    with pytest.raises(ConfigError) as err:
        Engine.resolve(both, torch.device("cpu"))
    assert err.value.problems == problems
    Engine.resolve(fsdp, torch.device("cpu"), training=False)  # an evaluation shards nothing
