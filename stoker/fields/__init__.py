"""How a configuration field is declared and a broken rule told: the base every section of the
run configuration derives from (``config`` sections and each model family's, ``families``).

A field carries its description, its bounds (they appear in the JSON schema, hence in the UI
form) and its ``fix``, which the error report appends to any problem of the field; a cross-field
rule is a field validator on the later field that raises ``_rule``. Imports nothing of stoker.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field
from pydantic_core import PydanticCustomError


# ---- declaring a field's checks --------------------------------------------------------
def _field(default: Any, description: str, *, fix: str | None = None, **constraints: Any) -> Any:
    """A field with its description, its bounds (they appear in the JSON schema, hence in the
    UI form) and the fix that the error report appends to any problem of this field."""
    return Field(default, description=description, json_schema_extra={"fix": fix} if fix else None, **constraints)


def _rule(what: str, fix: str | None = None) -> PydanticCustomError:
    """A broken cross-field rule, told as "<field>: <what> (got <value>); <fix>." ``fix``
    replaces the field's own where the fix depends on the values."""
    return PydanticCustomError("config_rule", what, {"fix": fix} if fix else None)


def _not_blank(value: str) -> str:
    if not value.strip():
        raise PydanticCustomError("blank", "is empty")
    return value


# min_length shows in the schema; the validator also refuses whitespace only.
NonBlank = Annotated[str, Field(min_length=1), AfterValidator(_not_blank)]


class _Section(BaseModel):
    # A cross-field rule is a field validator on the later field, reading the earlier ones
    # from ``info.data``. That holds only the earlier fields that validated, so a rule is
    # skipped (not misreported) when a field it reads is bad, and, unlike an after model
    # validator, it still runs when some other field of the section failed.
    # pydantic's own message never repeats a value (it could be a credential); ConfigError
    # lines show values, except for the secrets check below
    model_config = ConfigDict(extra="forbid", validate_assignment=True, hide_input_in_errors=True)
