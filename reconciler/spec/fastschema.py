"""A yes/no check of a document against our JSON Schemas without jsonschema.

Importing jsonschema costs ~50 ms per command; almost every file is valid.
This answers "valid" only when sure; anything else (an error, a keyword it
does not know, a comparison where JSON and Python equality differ) is
"not sure", and the caller asks jsonschema, which words the errors. So the
messages stay jsonschema's, and the fast answer can only ever be a "valid"
jsonschema agrees with (tests/test_fastschema.py compares the two).

Imported by spec/schemas.py.
"""

from __future__ import annotations

import re
from functools import cache

TYPE_CHECKING = False  # typing itself costs ~5 ms at start-up (`validate` never loads it)
if TYPE_CHECKING:
    from typing import Any

# Keywords that only annotate: they never make a document invalid.
_ANNOTATIONS = frozenset({"$schema", "$id", "$comment", "title", "description", "default",
                          "examples", "$defs", "deprecated", "readOnly", "writeOnly"})


class _NotSure(Exception):
    pass


_TYPES: dict[str, Any] = {
    "object": lambda v: isinstance(v, dict),
    "array": lambda v: isinstance(v, list),
    "string": lambda v: isinstance(v, str),
    # As schemas.py redefines it: a float is never an integer here.
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None,
}


@cache
def _pattern(p: str) -> re.Pattern[str]:
    return re.compile(p)


def _same(a: object, b: object) -> bool:
    """JSON equality where it is certain; bool/int/float mixes are jsonschema's call."""
    if type(a) is type(b) and (a is None or isinstance(a, (str, int, bool))):
        return a == b
    if isinstance(a, str) or isinstance(b, str) or a is None or b is None:
        return False  # a string or null never equals anything of another type
    raise _NotSure


def _ref(root: dict, ref: str) -> dict:
    if not ref.startswith("#/"):
        raise _NotSure
    node: Any = root
    for part in ref[2:].split("/"):
        node = node[part.replace("~1", "/").replace("~0", "~")]
    return node


def _valid(s: Any, v: Any, root: dict) -> bool:
    if s is True:
        return True
    if s is False or not isinstance(s, dict):
        return False if s is False else _bad()
    for key, arg in s.items():
        if key in _ANNOTATIONS:
            continue
        if not _keyword(key, arg, s, v, root):
            return False
    return True


def _bad() -> bool:
    raise _NotSure


def _keyword(key: str, arg: Any, s: dict, v: Any, root: dict) -> bool:
    match key:
        case "type":
            return any(_TYPES[t](v) for t in ([arg] if isinstance(arg, str) else arg))
        case "$ref":
            return _valid(_ref(root, arg), v, root)
        case "properties":
            return not isinstance(v, dict) or all(
                _valid(sub, v[k], root) for k, sub in arg.items() if k in v)
        case "additionalProperties":
            if not isinstance(v, dict):
                return True
            known = s.get("properties", {})
            if "patternProperties" in s:
                raise _NotSure
            return all(_valid(arg, val, root) for k, val in v.items() if k not in known)
        case "required":
            return not isinstance(v, dict) or all(k in v for k in arg)
        case "enum":
            return any(_same(v, e) for e in arg)
        case "const":
            return _same(v, arg)
        case "pattern":
            return not isinstance(v, str) or _pattern(arg).search(v) is not None
        case "minLength":
            return not isinstance(v, str) or len(v) >= arg
        case "maxLength":
            return not isinstance(v, str) or len(v) <= arg
        case "minItems":
            return not isinstance(v, list) or len(v) >= arg
        case "maxItems":
            return not isinstance(v, list) or len(v) <= arg
        case "items":
            return not isinstance(v, list) or all(_valid(arg, x, root) for x in v)
        case "uniqueItems":
            if not arg or not isinstance(v, list):
                return True
            if not all(isinstance(x, str) for x in v):
                raise _NotSure  # 1 == 1.0 == True questions: jsonschema decides
            return len(set(v)) == len(v)
        case "minimum" | "maximum" | "exclusiveMinimum" | "exclusiveMaximum":
            if not _TYPES["number"](v):
                return True
            return {"minimum": v >= arg, "maximum": v <= arg,
                    "exclusiveMinimum": v > arg, "exclusiveMaximum": v < arg}[key]
        case "oneOf":
            return sum(_valid(sub, v, root) for sub in arg) == 1
        case "anyOf":
            return any(_valid(sub, v, root) for sub in arg)
        case "allOf":
            return all(_valid(sub, v, root) for sub in arg)
    raise _NotSure  # a keyword this does not know


def surely_valid(schema: dict, instance: Any) -> bool:
    """True only when ``instance`` is valid for certain; False: ask jsonschema."""
    try:
        return _valid(schema, instance, schema)
    except (_NotSure, KeyError, TypeError, ValueError, re.error, RecursionError):
        return False
