"""A quick yes for engine results that match the result schema, so that jsonschema only runs on the rest.

jsonschema descends into every element of a result (one validator object per token id, top-k logit and
fingerprint value): about 10 µs each, a third of a second for a small greedy run, which made checking a
result cost as much as computing it. `conforms` reads the same schema file and applies its keywords to whole
lists at once. It answers exactly where it answers (the result types of `checks._validator`: integers are
ints, not bools or 5.0; numbers are finite), and gives up (False) on any keyword it does not know, so the
check then asks jsonschema, whose first error stays the one users read.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

_ANNOTATIONS = frozenset({"$schema", "$id", "title", "description"})
_SCALAR_ITEM_KEYS = frozenset({"type", "minimum", "maximum"}) | _ANNOTATIONS


class _Unsure(Exception):
    """The schema uses something this module does not interpret."""


def is_integer(value: Any) -> bool:
    """The result contract's integer: a JSON integer, not true/false and not 5.0."""
    return type(value) is int


def is_number(value: Any) -> bool:
    """The result contract's number: an integer or a finite float (Python reads 1e999 as inf)."""
    return type(value) is int or (type(value) is float and math.isfinite(value))


_TYPES = {
    "integer": is_integer,
    "number": is_number,
    "string": lambda v: type(v) is str,
    "null": lambda v: v is None,
    "object": lambda v: type(v) is dict,
    "array": lambda v: type(v) is list,
    "boolean": lambda v: type(v) is bool,
}


def _has_type(value: Any, want: Any) -> bool:
    if not isinstance(want, str) or want not in _TYPES:
        raise _Unsure
    return _TYPES[want](value)


def _equal(value: Any, want: Any) -> bool:
    """JSON equality for scalar constants: true is not 1, 1 is 1.0."""
    if isinstance(want, (dict, list)):
        raise _Unsure
    if type(value) is bool or type(want) is bool:
        return type(value) is type(want) and value == want
    return value == want


def _scalar_items(values: list, schema: Mapping[str, Any]) -> bool:
    """`items` of integers or numbers (with an optional minimum and maximum), over the whole list at once."""
    ok = all(map(_TYPES[schema["type"]], values))
    if not ok or not values:
        return ok
    return ("minimum" not in schema or min(values) >= schema["minimum"]) and \
        ("maximum" not in schema or max(values) <= schema["maximum"])


def _conforms(value: Any, schema: Mapping[str, Any]) -> bool:
    if type(schema) is not dict:
        raise _Unsure
    for key, want in schema.items():
        if key in _ANNOTATIONS:
            continue
        if key == "type":
            ok = _has_type(value, want)
        elif key == "const":
            ok = _equal(value, want)
        elif key == "required":
            ok = type(value) is not dict or all(k in value for k in want)
        elif key == "properties":
            ok = type(value) is not dict or all(_conforms(value[k], sub) for k, sub in want.items() if k in value)
        elif key == "items":
            if type(value) is not list:
                ok = True
            elif type(want) is dict and want.keys() <= _SCALAR_ITEM_KEYS and want.get("type") in ("integer", "number"):
                ok = _scalar_items(value, want)
            else:
                ok = all(_conforms(v, want) for v in value)
        elif key == "minItems":
            ok = type(value) is not list or len(value) >= want
        elif key == "minimum":
            ok = not is_number(value) or value >= want
        elif key == "maximum":
            ok = not is_number(value) or value <= want
        elif key == "oneOf":
            ok = sum(_conforms(value, sub) for sub in want) == 1
        else:
            raise _Unsure
        if not ok:
            return False
    return True


def conforms(instance: Any, schema: Mapping[str, Any]) -> bool:
    """True when `instance` matches `schema`; False when it does not, or when the schema holds a keyword
    this module does not interpret (the caller then validates with jsonschema)."""
    try:
        return _conforms(instance, schema)
    except _Unsure:
        return False
