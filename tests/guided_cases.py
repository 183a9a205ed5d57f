"""Constraints every structured-output test shares: at least 20 JSON Schemas of the
kinds the issue lists (nested objects, arrays with bounds, enums, string patterns,
numbers with ranges, anyOf, required and optional fields), regexes and choices.

Every string, array and object is bounded, so a model sampling at random over what
the grammar allows (the flat tiny model) reaches a complete output well within
MAX_TOKENS: a test may then require every output to be complete and valid.
"""
from __future__ import annotations

import json
import re

import jsonschema

MAX_TOKENS = 160


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "additionalProperties": False,
            "required": list(props) if required is None else required}


_INT9 = {"type": "integer", "minimum": 0, "maximum": 9}
_POINT = _obj({"x": {"type": "integer", "minimum": -9, "maximum": 9},
               "y": {"type": "integer", "minimum": -9, "maximum": 9}})

SCHEMAS: dict[str, dict] = {
    "flat_object": _obj({"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    "nested_object": _obj({"user": _obj({"id": _INT9, "email": {
        "type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,5}\\.(com|org)$"}}),
        "active": {"type": "boolean"}}),
    "deep_nesting": _obj({"a": _obj({"b": _obj({"c": {"type": "boolean"}})})}),
    "bounded_int_array": {"type": "array", "items": {"type": "integer", "minimum": -5,
                                                     "maximum": 5}, "minItems": 2, "maxItems": 4},
    "array_of_objects": {"type": "array", "maxItems": 3, "items": _obj(
        {"k": {"enum": ["a", "b", "c"]}, "v": _INT9})},
    "nested_arrays": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
        "type": "array", "maxItems": 3, "items": {"type": "boolean"}}},
    "enum_array": {"type": "array", "minItems": 1, "maxItems": 5,
                   "items": {"enum": ["low", "mid", "high"]}},
    "string_enum": {"type": "string", "enum": ["red", "green", "blue"]},
    "mixed_enum": {"enum": ["yes", 1, None, True]},
    "const_field": _obj({"version": {"const": 2}, "ok": {"type": "boolean"}}),
    "string_pattern": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
    "date_pattern": _obj({"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}),
    "string_lengths": {"type": "string", "minLength": 2, "maxLength": 5},
    "number_range": _obj({"p": {"type": "number", "minimum": 0.5, "maximum": 9.5,
                                "multipleOf": 0.25},
                          "q": {"type": "integer", "exclusiveMinimum": 10,
                                "exclusiveMaximum": 20}}),
    "negative_range": {"type": "integer", "minimum": -99, "maximum": -10},
    "any_of_scalars": {"anyOf": [_INT9, {"type": "string", "maxLength": 3}, {"type": "null"}]},
    "any_of_objects": {"anyOf": [
        _obj({"kind": {"const": "circle"}, "r": {"type": "integer", "minimum": 1, "maximum": 9}}),
        _obj({"kind": {"const": "square"}, "side": _INT9})]},
    "optional_fields": _obj({"a": {"type": "boolean"}, "b": _INT9,
                             "c": {"type": "string", "maxLength": 4}}, required=["a"]),
    "all_optional": _obj({"x": _INT9, "y": {"type": "boolean"}}, required=[]),
    "defs_and_refs": {"$defs": {"pt": _POINT}, **_obj({"a": {"$ref": "#/$defs/pt"},
                                                        "b": {"$ref": "#/$defs/pt"}})},
    "nullable": _obj({"note": {"type": ["string", "null"], "maxLength": 4}}),
    "pydantic_like": {"title": "Person", "type": "object", "additionalProperties": False,
                      "required": ["name", "age"], "properties": {
                          "name": {"title": "Name", "type": "string", "maxLength": 10},
                          "age": {"title": "Age", "type": "integer", "minimum": 0,
                                  "maximum": 99}}},
    "boolean": {"type": "boolean"},
}

REGEXES = [r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)", r"\d{3}-\d{4}", r"(yes|no|maybe)",
           r"[A-F0-9]{2}(:[A-F0-9]{2}){2}", r"(0|[1-9][0-9]{0,2})(\.[0-9]{1,2})?"]
CHOICES = [["red", "green", "blue"], ["positive", "negative", "neutral"],
           ["a", "ab", "abc"], ["true", "false"]]


def assert_valid(name: str, text: str) -> None:
    """The output parses and validates against SCHEMAS[name]."""
    try:
        jsonschema.validate(json.loads(text), SCHEMAS[name])
    except (json.JSONDecodeError, jsonschema.ValidationError) as e:
        raise AssertionError(f"{name}: {text!r} does not validate: {e}") from None


def assert_matches(regex: str, text: str) -> None:
    assert re.fullmatch(regex, text), f"{text!r} does not match {regex!r}"

COSTLY_TO_COMPILE = {"allOf": [{"anyOf": [{"type": "string", "pattern": f"^.*{chr(97 + i)}{j}.*$"}
                                          for j in range(4)]} for i in range(7)]}
"""1.3 KB; llguidance builds it for about 30 s here (intersecting the patterns), in
one call no ParserLimits field bounds."""
COSTLY_TO_SEARCH = {"type": "array", "items": {"type": "string", "minLength": 50},
                    "minItems": 1000}
"""Compiles at once; its shortest-output search ran 16 s here before it gave up."""
