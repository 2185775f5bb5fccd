import json

import pytest

from core.config import RECIPES_DIR, ConfigError, RunConfig, load_config


@pytest.mark.parametrize("recipe", sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")))
def test_every_recipe_loads_and_checks(recipe):
    cfg = load_config(recipe)
    assert cfg.grad_accum_steps >= 1
    assert RunConfig.model_validate_json(cfg.to_json()) == cfg


def test_recipes_exist():
    assert {"tiny-cpu", "gpt2-124m"} <= {p.stem for p in RECIPES_DIR.glob("*.yaml")}


def test_bad_config_lists_every_problem_at_once(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config({
            "storage": {"root": "file://" + str(tmp_path)},
            "train": {"lr": -0.1, "global_batch_size": 10, "micro_batch_size": 4},
            "data": {"source": str(tmp_path / "no-such-corpus" / "*.txt")},
        })
    problems = err.value.problems
    assert len(problems) == 3, problems
    text = str(err.value)
    assert "train.lr" in text and "3e-4" in text
    assert "train.global_batch_size" in text and "world_size x micro_batch_size" in text
    assert "data.source" in text and "no file matches" in text


def test_type_errors_are_reported_together():
    with pytest.raises(ConfigError) as err:
        load_config({"train": {"max_steps": "many", "lr": "fast"}, "model": {"n_layer": []}})
    assert len(err.value.problems) == 3
    assert any(p.startswith("train.max_steps") for p in err.value.problems)


def test_unknown_field_is_rejected_with_its_name():
    with pytest.raises(ConfigError, match="train.learning_rate"):
        load_config({"train": {"learning_rate": 1e-3}})


def test_every_field_is_described():
    def walk(model_cls, prefix=""):
        for name, field in model_cls.model_fields.items():
            assert field.description, f"{prefix}{name} has no description"
            ann = field.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                walk(ann, f"{prefix}{name}.")

    walk(RunConfig)


def test_default_run_name_follows_the_config(tmp_path):
    root = {"storage": {"root": "file://" + str(tmp_path)}}
    a, b = load_config(root), load_config(root)
    c = load_config({**root, "train": {"max_steps": 301}})
    assert a.resolved_run_name() == b.resolved_run_name() != c.resolved_run_name()
    assert load_config({**root, "run_name": "mine"}).resolved_run_name() == "mine"


def test_overrides_and_json_schema_for_the_ui():
    cfg = load_config("tiny-cpu", **{"train.max_steps": 70, "model__n_layer": 1})
    assert cfg.train.max_steps == 70 and cfg.model.n_layer == 1
    schema = RunConfig.model_json_schema()
    assert json.dumps(schema)  # renders as a form in the Prefect UI


def test_the_tiny_cpu_recipe_is_the_embedded_default():
    assert load_config("tiny-cpu") == RunConfig()
