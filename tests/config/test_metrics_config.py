"""The `metrics` section: sinks off by default, a missing extra told with the fix before
anything runs, no credentials in a tracking URI, and no effect on the run's identity."""

import sys

import pytest

from stoker.config import ConfigError, load_config


def test_sinks_are_off_by_default():
    m = load_config().metrics
    assert (m.tensorboard_enabled, m.mlflow_tracking_uri) == (False, None)


def test_a_sink_whose_package_is_missing_is_a_config_error_with_the_others(monkeypatch):
    for module in ("tensorboard", "mlflow"):  # as if the 'metrics' extra were not installed
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ConfigError) as err:
        load_config(
            None,
            **{
                "metrics.tensorboard_enabled": True,
                "metrics.mlflow_tracking_uri": "http://127.0.0.1:5000",
                "train.lr": -1,
            },
        )
    assert err.value.problems == [
        "train.lr: must be > 0 (got -1); a typical value is 3e-4.",
        "metrics.tensorboard_enabled: needs the 'tensorboard' package, which is not installed "
        "here; pip install 'stoker[metrics]', or turn the sink off.",
        "metrics.mlflow_tracking_uri: needs the 'mlflow' package, which is not installed here; "
        "pip install 'stoker[metrics]', or turn the sink off.",
    ]
    load_config(None, **{"metrics.tensorboard_enabled": False})  # off: nothing is needed


@pytest.mark.parametrize(
    "uri,says",
    [
        ("http://user:hunter2@mlflow.example:5000", "holds credentials"),
        ("file://mlruns", "is a relative file:// URL"),
        ("mlruns", "is relative"),
    ],
)
def test_a_tracking_uri_that_cannot_work_is_refused(uri, says):
    with pytest.raises(ConfigError) as err:
        load_config(None, **{"metrics.mlflow_tracking_uri": uri})
    assert len(err.value.problems) == 1 and says in err.value.problems[0]
    assert "hunter2" not in str(err.value)


def test_the_sinks_leave_the_run_identity_alone(tmp_path):
    plain = load_config()
    with_sinks = load_config(
        None, **{"metrics.tensorboard_enabled": True, "metrics.mlflow_tracking_uri": f"sqlite:///{tmp_path}/m.db"}
    )
    assert with_sinks.resolved_run_name() == plain.resolved_run_name()
    assert with_sinks.model_hash() == plain.model_hash()
