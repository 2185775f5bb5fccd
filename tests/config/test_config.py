import json

import pytest

from stoker.config import RECIPES_DIR, ConfigError, DataConfig, RunConfig, load_config, local_resource_problems
from tests.conftest import tiny_dict


@pytest.mark.parametrize("recipe", sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")))
def test_every_recipe_loads_and_checks(recipe):
    cfg = load_config(recipe)
    if cfg.train.micro_batch_size == "auto":  # settled by the ranks: the plan's value here
        from stoker.arithmetic.plan import Hardware, auto_micro_batch

        m = auto_micro_batch(cfg, Hardware.named(cfg.launch.accelerator))
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"micro_batch_size": m})})
    assert cfg.grad_accum_steps >= 1
    assert RunConfig.model_validate_json(cfg.to_json()) == cfg


def test_recipes_exist():
    assert {"tiny-cpu", "gpt2-124m"} <= {p.stem for p in RECIPES_DIR.glob("*.yaml")}


def test_bad_config_lists_every_problem_at_once(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(
            {
                "storage": {"root": "file://" + str(tmp_path)},
                "train": {"lr": -0.1, "global_batch_size": 10, "micro_batch_size": 4},
                "data": {"source": str(tmp_path / "no-such-corpus" / "*.txt")},
            }
        )
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
    recipe = load_config("tiny-cpu")
    assert recipe.recipe == "tiny-cpu"  # the name it was loaded by (no part of the identity)
    assert recipe.model_copy(update={"recipe": None}) == RunConfig()
    assert recipe.identity_hash() == RunConfig().identity_hash()


def _field_schema(schema, *path):
    """One field's JSON schema, following the $defs references of nested sections."""
    node = schema
    for name in path:
        node = node["properties"][name]
        if "$ref" in node:
            node = {**schema["$defs"][node["$ref"].rsplit("/", 1)[-1]], **node}
    return node


def test_bounds_and_fixes_are_in_the_json_schema():
    schema = RunConfig.model_json_schema()
    assert _field_schema(schema, "train", "lr")["exclusiveMinimum"] == 0
    assert _field_schema(schema, "checkpoint", "keep_latest_k")["minimum"] == 2
    workers = _field_schema(schema, "data", "num_workers")
    [number] = [b for b in workers["anyOf"] if b.get("type") == "integer"]
    assert (number["minimum"], number["maximum"]) == (1, 256)
    assert {"const": "auto", "type": "string"} in workers["anyOf"] or any(
        b.get("enum") == ["auto"] or b.get("const") == "auto" for b in workers["anyOf"]
    )
    assert _field_schema(schema, "data", "val_fraction")["exclusiveMaximum"] == 0.5
    assert _field_schema(schema, "data", "text_field")["minLength"] == 1
    assert "3e-4" in _field_schema(schema, "train", "lr")["fix"]
    assert _field_schema(schema, "train", "lr")["description"]


def test_bounds_section_rules_and_cross_section_rules_are_reported_together(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(
            {
                "storage": {"root": "file://" + str(tmp_path)},
                "train": {"lr": -0.1, "global_batch_size": 10, "micro_batch_size": 4},
                "model": {"n_head": 4, "n_embd": 130},
                "checkpoint": {"keep_latest_k": 1},
                "launch": {"hang_timeout_seconds": 3},
            }
        )
    problems = err.value.problems
    assert len(problems) == 5, problems
    expected = {
        "train.lr": ("must be > 0 (got -0.1)", "3e-4"),
        "train.global_batch_size": ("world_size x micro_batch_size", "use a multiple of 8"),
        "model.n_embd": ("not divisible by n_head=4", "pick a multiple of 4"),
        "checkpoint.keep_latest_k": ("must be >= 2 (got 1)", "keep at least 2"),
        "launch.hang_timeout_seconds": ("must be 0 (watchdog off) or >= 5 (got 3)", "e.g. 300"),
    }
    for field, (what, fix) in expected.items():
        [line] = [p for p in problems if p.startswith(field + ":")]
        assert what in line and fix in line, line
    # the model alone says the same, without the config file round trip
    with pytest.raises(ValueError):
        RunConfig.model_validate({"train": {"lr": -0.1, "global_batch_size": 10}})


def test_a_rule_is_skipped_when_a_field_it_reads_is_bad():
    with pytest.raises(ConfigError) as err:  # min_lr > lr, but lr itself is the problem
        load_config({"train": {"lr": -1.0, "min_lr": 0.5}})
    assert [p.split(":")[0] for p in err.value.problems] == ["train.lr"]
    assert RunConfig().check() == RunConfig()


def test_the_model_never_touches_the_filesystem(tmp_path):
    missing = str(tmp_path / "no-such-corpus.jsonl")
    text = RunConfig(data=DataConfig(source=missing)).to_json()
    assert RunConfig.model_validate_json(text).check().data.source == missing
    with pytest.raises(ConfigError) as err:
        load_config(json.loads(text))
    [problem] = err.value.problems
    assert problem.startswith("data.source: no file matches") and missing in problem


def test_an_empty_folder_is_no_data(tmp_path):
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    cfg = RunConfig(data=DataConfig(source=str(tmp_path / "empty")))
    [problem] = local_resource_problems(cfg)
    assert problem.startswith("data.source: no file matches")
    (tmp_path / "empty" / "sub" / "a.txt").write_text("text")
    assert local_resource_problems(cfg) == []
    assert (
        "tokenizer.path"
        in local_resource_problems(
            cfg.model_copy(update={"tokenizer": cfg.tokenizer.model_copy(update={"path": str(tmp_path / "tok.json")})})
        )[0]
    )


@pytest.mark.parametrize(
    "over,field,says",
    [
        ({"storage.root": "s3://"}, "storage.root", "names no bucket"),
        ({"storage.root": "s3:///prefix"}, "storage.root", "names no bucket"),
        ({"storage.root": "file://relative/dir"}, "storage.root", "three slashes"),
        ({"data.source": "s3://"}, "data.source", "names no bucket"),
        ({"data.source": "https:///corpus.jsonl"}, "data.source", "names no host"),
        ({"tokenizer.vocab_size": 70000, "data.token_dtype": "uint16"}, "data.token_dtype", "use 'uint32' or 'auto'"),
    ],
)
def test_urls_and_id_widths_that_cannot_work_are_config_errors(over, field, says):
    """Found from the config alone, before any task runs: one line naming the field and the fix."""
    with pytest.raises(ConfigError) as err:
        load_config(None, **over)
    [line] = err.value.problems
    assert line.startswith(field + ":") and says in line, line


def test_a_wide_vocabulary_is_fine_with_auto_or_uint32_ids():
    assert load_config(None, **{"tokenizer.vocab_size": 70000}).tokenizer.vocab_size == 70000
    assert load_config(None, **{"tokenizer.vocab_size": 70000, "data.token_dtype": "uint32"})


def test_max_pending_uploads_below_one_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ConfigError, match="checkpoint.max_pending_uploads") as err:
        load_config(tiny_dict("file://" + str(tmp_path), checkpoint={"max_pending_uploads": 0}))
    assert "give at least 1" in str(err.value)


_TWO_HOSTS = [
    {"prefix": ["ssh", "host0"], "address": "10.0.0.10"},
    {"prefix": ["ssh", "host1"], "address": "10.0.0.11"},
]


@pytest.mark.parametrize(
    "launch,field,says",
    [
        (
            {"nodes": _TWO_HOSTS[:1], "rdzv_host": "10.0.0.10", "rdzv_port": 29500},
            "launch.nodes",
            "gives 1 node(s) for num_nodes=2 (got [{'prefix': ['ssh', 'host0']",
        ),
        (
            {"nodes": _TWO_HOSTS, "rdzv_port": 29500},
            "launch.rdzv_host",
            "is no node's address: the rendezvous is hosted by the node whose address it is (got "
            "'127.0.0.1'); give one of ['10.0.0.10', '10.0.0.11']",
        ),
        (
            {"nodes": [{"address": "10.0.0.10"}, {"address": "10.0.0.10"}], "rdzv_host": "10.0.0.10"},
            "launch.rdzv_host",
            "is the address of nodes [0, 1]",
        ),
        (
            {"nodes": _TWO_HOSTS, "rdzv_host": "10.0.0.11"},
            "launch.rdzv_port",
            "is needed: the rendezvous host 10.0.0.11 is node 1, started on another machine (ssh)",
        ),
        (
            {"nodes": [{"prefix": ["ssh host0"], "address": "10.0.0.10"}, _TWO_HOSTS[1]], "rdzv_host": "10.0.0.10"},
            "launch.nodes.0.prefix",
            "is one shell string (got ['ssh host0']); give one word per item: ['ssh', 'host0']",
        ),
        (
            {"nodes": [{"prefix": "ssh host0", "address": "10.0.0.10"}, _TWO_HOSTS[1]], "rdzv_host": "10.0.0.10"},
            "launch.nodes.0.prefix",
            "give the command as a list of words",
        ),
        (
            {
                "nodes": [_TWO_HOSTS[0], {**_TWO_HOSTS[1], "adress": "10.0.0.11"}],
                "rdzv_host": "10.0.0.10",
                "rdzv_port": 29500,
            },
            "launch.nodes.1.adress",
            "did you mean launch.nodes.1.address?",
        ),
        (
            {"nodes": [{"address": "10.0.0.10"}, {"address": "host 1"}], "rdzv_host": "10.0.0.10"},
            "launch.nodes.1.address",
            "is not an address (got 'host 1'); give an IP address or host name",
        ),
        (
            {"nodes": [{"address": "10.0.0.10", "env": {"GLOO-IFNAME": "eth1"}}, {}], "rdzv_host": "10.0.0.10"},
            "launch.nodes.0.env",
            "['GLOO-IFNAME'] cannot be an environment variable's name",
        ),
        (
            {"launcher": "ray", "nodes": _TWO_HOSTS, "rdzv_host": "10.0.0.10", "rdzv_port": 29500},
            "launch.nodes",
            "remove launch.nodes (Ray places its workers)",
        ),
    ],
)
def test_launch_nodes_rules_name_the_field_and_the_fix(launch, field, says, tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(tiny_dict("file://" + str(tmp_path), launch={"num_nodes": 2, "nproc_per_node": 1, **launch}))
    problems = [p for p in err.value.problems if not p.startswith("launch.launcher")]  # Ray may be absent
    [line] = problems
    assert line.startswith(field + ":") and says in line, line


def test_credentials_in_a_nodes_env_are_refused_and_never_shown(tmp_path):
    nodes = [{"address": "10.0.0.10", "env": {"AWS_SECRET_ACCESS_KEY": "hunter2", "STOKER_CACHE": "/c"}}, {}]
    with pytest.raises(ConfigError) as err:
        load_config(
            tiny_dict(
                "file://" + str(tmp_path),
                launch={"num_nodes": 2, "nproc_per_node": 1, "rdzv_host": "10.0.0.10", "nodes": nodes},
            )
        )
    [line] = err.value.problems
    assert line.startswith("launch.nodes.0.env: holds credentials (AWS_SECRET_ACCESS_KEY)")
    assert "hunter2" not in str(err.value) and "AWS_PROFILE" in line


def test_launch_nodes_that_follow_the_rules_load(tmp_path):
    """Remote rendezvous with its port; a rendezvous node on this host (no prefix) without one,
    its port picked at launch; an empty list is no list (the UI form's)."""

    def launch(**values):
        return load_config(
            tiny_dict("file://" + str(tmp_path), launch={"num_nodes": 2, "nproc_per_node": 1, **values})
        ).launch

    remote = launch(nodes=_TWO_HOSTS, rdzv_host="10.0.0.11", rdzv_port=29500)
    assert [n.prefix for n in remote.nodes] == [["ssh", "host0"], ["ssh", "host1"]]
    here = launch(nodes=[{"address": "10.0.0.10"}, _TWO_HOSTS[1]], rdzv_host="10.0.0.10")
    assert here.rdzv_port is None and here.nodes[0].prefix == []
    assert launch(nodes=[]).nodes is None
    cfg = load_config(tiny_dict("file://" + str(tmp_path)))
    assert (
        cfg.identity_hash()
        == load_config(
            tiny_dict(
                "file://" + str(tmp_path),
                launch={
                    "num_nodes": 2,
                    "nproc_per_node": 1,
                    "nodes": _TWO_HOSTS,
                    "rdzv_host": "10.0.0.10",
                    "rdzv_port": 29500,
                },
            )
        ).identity_hash()
    )  # where it runs is no part of what it is
