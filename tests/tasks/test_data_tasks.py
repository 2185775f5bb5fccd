"""The data stage's tasks for a mixture: a source's own mistake names its field in data.sources."""

import pytest

from stoker.config import build_config
from stoker.failures import DataError
from tests.conftest import tiny_dict


def test_a_sources_data_error_names_its_field_in_the_mixture(tmp_path):
    from stoker.tasks.data import download_dataset

    missing = str(tmp_path / "nothing" / "*.jsonl")
    cfg = build_config(  # load_config would refuse the missing source before any task: the task is the subject
        tiny_dict("file://" + str(tmp_path / "store"), data={"sources": [{"name": "web", "source": missing}]})
    )
    [(name, _, one)] = cfg.data.source_configs()
    with pytest.raises(DataError, match=r"^data\.sources\[web\]\.source: .* matches no file") as err:
        download_dataset.fn(one, cfg.storage, name)
    assert str(err.value).count("\n") == 0
