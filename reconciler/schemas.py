"""The JSON Schemas in ``schemas/`` and errors phrased for people."""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema

from .diagnostics import format_field
from .yamldoc import Document

SCHEMA_DIR = Path(__file__).resolve().parent.parent / "schemas"


@cache
def validator(name: str) -> jsonschema.Draft202012Validator:
    # The schemas are checked against the metaschema in the tests, not on
    # every command start (that costs ~11 ms).
    schema = json.loads((SCHEMA_DIR / f"{name}.schema.json").read_text())
    return jsonschema.Draft202012Validator(schema)


def _message(err: jsonschema.ValidationError) -> tuple[tuple[str | int, ...], str, bool]:
    """(field path, message, point-at-key) for one schema error."""
    path = tuple(err.absolute_path)
    schema: dict[str, Any] = err.schema if isinstance(err.schema, dict) else {}
    described = schema.get("description")
    match err.validator:
        case "additionalProperties":
            allowed = sorted(schema.get("properties", {}))
            extra = sorted(k for k in err.instance if k not in allowed)
            return (*path, extra[0]), f"unknown field; expected one of: {', '.join(allowed)}", True
        case "required":
            missing = err.message.split("'")[1] if "'" in err.message else err.message
            return (*path, missing), "required field is missing", False
        case "const":
            return path, f"must be {err.validator_value!r}, got {err.instance!r}", False
        case "pattern" | "oneOf" if described:
            return path, f"{err.instance!r} is not valid: expected {described}", False
        case "oneOf":
            return path, f"{err.instance!r} is not valid here", False
    return path, err.message, False


def schema_errors(name: str, doc: Document) -> Iterator[tuple[tuple[int, int], str, str]]:
    """Yield ((line, column), field, message) for each schema violation of ``doc``."""
    errors = sorted(validator(name).iter_errors(doc.data), key=lambda e: list(map(str, e.path)))
    for err in errors:
        path, message, at_key = _message(err)
        yield doc.where(path, key=at_key), format_field(path), message
