"""Telling a validation error: one line per problem, ``<dotted field>: <what> (got
<value>); <fix>.``, the fix taken from the rule or from the field's schema, and the closest
field's name (did you mean ...?) for an unknown key.

Each function takes the root model the error's locations start from (``RunConfig``), so this
module imports no model.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

_BOUNDS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}
_OPS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def _model_in(ann: Any) -> Any:
    """The section model an annotation holds (``Model``, ``list[Model] | None``), or None."""
    import typing

    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return ann
    for arg in typing.get_args(ann):
        model = _model_in(arg)
        if model is not None:
            return model
    return None


def _field_at(loc: tuple, root: type[BaseModel]) -> Any:
    """The FieldInfo an error location names (the deepest one that is a field), or None."""
    model: Any = root
    field = None
    for part in loc:
        if isinstance(part, int) and field is not None:  # an item of a list of sections
            continue
        if model is None or part not in model.model_fields:
            break
        field = model.model_fields[part]
        model = _model_in(field.annotation)
    return field


def _did_you_mean(loc: tuple, root: type[BaseModel]) -> str:
    """The fix for an unknown key: the closest field of its section, or the section's fields."""
    import difflib

    model: Any = root
    for part in loc[:-1]:
        if isinstance(part, int):  # an item of a list of sections
            continue
        field = model.model_fields.get(part) if model is not None else None
        model = _model_in(field.annotation) if field is not None else None
    if model is None:
        return "remove it or check its spelling"
    names = list(model.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.6)
    if close:
        return f"did you mean {'.'.join(map(str, loc[:-1] + (close[0],)))}?"
    where = ".".join(map(str, loc[:-1])) or "the config"
    return f"remove it or check its spelling ({where} has: {', '.join(names)})"


def field_range(field: Any) -> str:
    """A field's bounds as a person writes them: '> 0', '>= 2', 'in [1, 256]', 'in (0, 0.5)'."""
    b = {k: getattr(m, k) for m in field.metadata for k in _OPS if getattr(m, k, None) is not None}
    lo = f"[{b['ge']}" if "ge" in b else f"({b['gt']}" if "gt" in b else ""
    hi = f"{b['le']}]" if "le" in b else f"{b['lt']})" if "lt" in b else ""
    if lo and hi:
        return f"in {lo}, {hi}"
    return " and ".join(f"{_OPS[k]} {v}" for k, v in b.items())


def problem_line(e: Any, root: type[BaseModel]) -> str:
    """One line per problem: '<dotted field>: <what> (got <value>); <fix>.' ``e`` is one of
    ``ValidationError.errors()``, whose location starts at the model ``root``."""
    loc = tuple(e["loc"])
    field = _field_at(loc, root)
    extra = field.json_schema_extra if field is not None else None
    fix = (e.get("ctx") or {}).get("fix") or (extra.get("fix") if isinstance(extra, dict) else None)
    if e["type"] in _BOUNDS and field is not None:
        what = "must be " + field_range(field)
    elif e["type"] in ("blank", "string_too_short"):
        what = "is empty"
    elif e["type"] == "extra_forbidden":
        what, fix = "is not a field of the config", _did_you_mean(loc, root)
    else:
        what = e["msg"]
    got = repr(e["input"]) if e["type"] != "secret_in_config" else "<not shown>"
    got = got if len(got) <= 80 else got[:77] + "..."  # a whole section is no help to read
    line = f"{'.'.join(map(str, loc)) or 'config'}: {what} (got {got})"
    if not fix:
        return f"{line}."
    return f"{line}; {fix}" + ("" if fix.endswith(("?", ".")) else ".")


def problem_lines(err: ValidationError, root: type[BaseModel]) -> list[str]:
    """A line for each problem of ``err``, raised validating the model ``root``."""
    return [problem_line(e, root) for e in err.errors()]
