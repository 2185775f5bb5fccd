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


def _models_in(ann: Any) -> list:
    """Every section model an annotation holds (the members of a union of sections)."""
    import typing

    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return [ann]
    return [m for arg in typing.get_args(ann) for m in _models_in(arg)]


def _member(ann: Any, tag: Any) -> Any:
    """The member of a tagged union of sections (``model``: one per ``family``) named by the
    tag pydantic puts in an error's location, or None."""
    for model in _models_in(ann):
        family = model.model_fields.get("family")
        if family is not None and family.default == tag:
            return model
    return None


def _walk(loc: tuple, root: type[BaseModel]) -> tuple[Any, Any, tuple]:
    """(the FieldInfo the location names, the section model it leads to, the location as a
    person writes it: without the union tags pydantic adds)."""
    model: Any = root
    field, ann, shown = None, None, []
    for i, part in enumerate(loc):
        if isinstance(part, int) and field is not None:  # an item of a list of sections
            shown.append(part)
            continue
        tagged = _member(ann, part) if ann is not None else None
        if tagged is not None:  # the family tag of a union: not a field of its own
            model = tagged
            continue
        if model is None or part not in model.model_fields:
            return field, None, tuple(shown) + tuple(loc[i:])
        field = model.model_fields[part]
        ann = field.annotation
        model = _model_in(ann)
        shown.append(part)
    return field, model, tuple(shown)


def _field_at(loc: tuple, root: type[BaseModel]) -> Any:
    """The FieldInfo an error location names (the deepest one that is a field), or None."""
    return _walk(loc, root)[0]


def _did_you_mean(loc: tuple, root: type[BaseModel]) -> str:
    """The fix for an unknown key: the closest field of its section, or the section's fields."""
    import difflib

    _, model, shown = _walk(loc[:-1], root)
    loc = shown + loc[-1:]
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
    field, _, loc = _walk(tuple(e["loc"]), root)
    extra = field.json_schema_extra if field is not None else None
    fix = (e.get("ctx") or {}).get("fix") or (extra.get("fix") if isinstance(extra, dict) else None)
    if e["type"] in _BOUNDS and field is not None:
        what = "must be " + field_range(field)
    elif e["type"] in ("blank", "string_too_short"):
        what = "is empty"
    elif e["type"] == "extra_forbidden":
        what, fix = "is not a field of the config", _did_you_mean(tuple(e["loc"]), root)
    elif e["type"] == "union_tag_invalid":
        what = f"names no model family ({e['ctx']['tag']!r})"
        fix = f"set model.family to one of {e['ctx']['expected_tags']}"
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
