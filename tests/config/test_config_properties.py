"""Property-based: any input to the config model or to the CLI's --set parser either
validates or raises the project's ConfigError, never anything else (no TypeError, no
pydantic traceback reaching the user)."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stoker.cli import config_from_args
from stoker.config import RunConfig, load_config
from stoker.failures import ConfigError

FIELDS = [
    f"{section}.{name}"
    for section, info in RunConfig.model_fields.items()
    if hasattr(info.annotation, "model_fields")
    for name in info.annotation.model_fields
]
KEYS = st.one_of(
    st.sampled_from(FIELDS + list(RunConfig.model_fields)),
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz._", min_size=1, max_size=24),
)
VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=16),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(st.dictionaries(KEYS, VALUES, max_size=5))
def test_any_overrides_validate_or_raise_one_config_error(overrides):
    try:
        cfg = load_config(None, **overrides)
    except ConfigError as err:
        assert err.problems and all(isinstance(p, str) and p for p in err.problems)
    else:
        assert RunConfig.model_validate_json(cfg.to_json()) == cfg  # what validates round-trips


@SETTINGS
@given(
    st.dictionaries(st.one_of(st.sampled_from(list(RunConfig.model_fields)), st.text(max_size=10)), VALUES, max_size=4)
)
def test_any_whole_config_document_validates_or_raises_one_config_error(document):
    try:
        load_config(document)
    except ConfigError:
        pass


@SETTINGS
@given(
    st.lists(
        st.one_of(st.builds(lambda k, v: f"{k}={v}", KEYS, st.text(max_size=20)), st.text(max_size=30)), max_size=4
    )
)
def test_any_set_arguments_validate_or_raise_one_config_error(sets):
    try:
        config_from_args("tiny-cpu", sets)
    except ConfigError:
        pass
