"""The one place stoker leans on a private Ray API (training.ray_main._trainer_class overrides
TorchTrainer._create_default_callbacks: Ray has no public way to leave out a default callback),
isolated and checked here: when Ray renames the method or the two callbacks stoker leaves out,
this fails, instead of a launch quietly starting two helper actors per run again."""

import os

import pytest

pytest.importorskip("ray")


def test_the_trainer_leaves_out_exactly_the_two_helpers_it_names(monkeypatch):
    monkeypatch.setenv("RAY_TRAIN_V2_ENABLED", "1")  # as launch.ray starts the driver
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    from stoker.training.ray_main import _UNNEEDED_CALLBACKS, _trainer_class

    assert hasattr(TorchTrainer, "_create_default_callbacks"), "Ray renamed the method stoker overrides"
    scaling = ScalingConfig(num_workers=1)
    theirs = [type(c).__name__ for c in TorchTrainer(lambda: None, scaling_config=scaling)._create_default_callbacks()]
    assert set(_UNNEEDED_CALLBACKS) <= set(theirs), f"Ray renamed a callback stoker leaves out: {theirs}"
    ours = [
        type(c).__name__ for c in _trainer_class()(lambda: None, scaling_config=scaling)._create_default_callbacks()
    ]
    assert ours == [name for name in theirs if name not in _UNNEEDED_CALLBACKS]
    assert "BackendSetupCallback" in ours and os.environ["RAY_TRAIN_V2_ENABLED"] == "1"
