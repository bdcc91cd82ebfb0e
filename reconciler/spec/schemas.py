"""The JSON Schemas in ``schemas/`` and errors phrased for people.

Imported by spec/config.py, spec/fleet.py, spec/loader.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import cache
from pathlib import Path

from reconciler.spec.diagnostics import excerpt, format_field
from reconciler.spec.fastschema import surely_valid
from reconciler.spec.yamldoc import Document

TYPE_CHECKING = False  # typing itself costs ~5 ms at start-up (`validate` never loads it)
if TYPE_CHECKING:
    from typing import Any

    import jsonschema

# One source of truth, the repository's top-level schemas/: a wheel carries
# it as the package data reconciler/_schemas (pyproject maps the directory).
_PACKAGE = Path(__file__).resolve().parent.parent  # reconciler/
SCHEMA_DIRS = (_PACKAGE / "_schemas", _PACKAGE.parent / "schemas")  # installed; source checkout


def schema_text(name: str) -> str:
    """The text of ``schemas/NAME.schema.json``, wherever the package lives."""
    filename = f"{name}.schema.json"
    for directory in SCHEMA_DIRS:
        path = directory / filename
        if path.is_file():
            return path.read_text()
    # Not a plain directory (a zip, a custom loader): the resource API. Last,
    # because importing importlib.resources costs ~29 ms on every start.
    from importlib.resources import files

    return files("reconciler._schemas").joinpath(filename).read_text()


@cache
def schema(name: str) -> dict[str, Any]:
    return json.loads(schema_text(name))


@cache
def validator(name: str) -> jsonschema.protocols.Validator:
    """jsonschema (imported only when a document may be invalid: ~50 ms)."""
    import jsonschema
    import jsonschema.validators

    # JSON Schema counts 1048576.0 as an integer; YAML wrote a float, and a
    # float is never a size or a count here (fastschema agrees).
    types = jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda _checker, value: isinstance(value, int) and not isinstance(value, bool))
    cls = jsonschema.validators.extend(jsonschema.Draft202012Validator, type_checker=types)
    # The schemas are checked against the metaschema in the tests, not on
    # every command start (that costs ~11 ms).
    return cls(schema(name))


_BOUNDS = {
    "minLength": "is too short (at least {} characters)",
    "maxLength": "is too long (at most {} characters)",
    "minItems": "is too short (at least {} items)",
    "maxItems": "is too long (at most {} items)",
    "minimum": "is less than the minimum of {}",
    "maximum": "is greater than the maximum of {}",
    "exclusiveMinimum": "must be greater than {}",
    "exclusiveMaximum": "must be less than {}",
    "minProperties": "is empty: name one source",
    "maxProperties": "names more than {} source (pick one)",
}


def _message(err: jsonschema.ValidationError) -> tuple[tuple[str | int, ...], str, bool]:
    """(field path, message, point-at-key) for one schema error.

    jsonschema's own messages quote the whole instance (a whole file, when a
    document is one string); ours quote an excerpt.
    """
    path = tuple(err.absolute_path)
    schema: dict[str, Any] = err.schema if isinstance(err.schema, dict) else {}
    described = schema.get("description")
    value, got = err.validator_value, excerpt(err.instance)
    match err.validator:
        case "additionalProperties":
            allowed = sorted(schema.get("properties", {}))
            extra = sorted(k for k in err.instance if k not in allowed)
            return (*path, extra[0]), f"unknown field; expected one of: {', '.join(allowed)}", True
        case "required":
            missing = next(k for k in value if k not in err.instance)
            return (*path, missing), "required field is missing", False
        case "const":
            return path, f"must be {value!r}, got {got}", False
        case "pattern" | "oneOf" if described:
            return path, f"{got} is not valid: expected {described}", False
        case "pattern":
            return path, f"{got} does not match {value!r}", False
        case "oneOf":
            return path, f"{got} is not valid here", False
        case "type":
            types = [value] if isinstance(value, str) else value
            return path, f"{got} is not of type {', '.join(map(repr, types))}", False
        case "enum":
            return path, f"{got} is not one of {', '.join(map(repr, value))}", False
        case "uniqueItems":
            return path, f"{got} has repeated items", False
        case bound if bound in _BOUNDS:
            return path, f"{got} {_BOUNDS[bound].format(value)}", False
    return path, f"{got} is not valid ({err.validator} {excerpt(value)})", False


def schema_errors(name: str, doc: Document) -> Iterator[tuple[tuple[int, int], str, str]]:
    """Yield ((line, column), field, message) for each schema violation of ``doc``."""
    if surely_valid(schema(name), doc.data):
        return
    errors = sorted(validator(name).iter_errors(doc.data), key=lambda e: list(map(str, e.path)))
    for err in errors:
        path, message, at_key = _message(err)
        yield doc.where(path, key=at_key), format_field(path), message
