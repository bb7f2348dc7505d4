"""Checks every protocol applies to a tool's parameter schema before the engine sees it.

vLLM accepts a malformed schema and runs the request anyway (the tool parser and the grammar
then misbehave quietly), so the gateway refuses it with the field that is wrong."""

from __future__ import annotations

from typing import Any

from gateway.protocols.errors import bad_request


def check_object_schema(schema: Any, path: str) -> None:
    """`schema` (at `path` in the request) must describe a JSON object: type 'object', and
    `properties` / `required` of the right kinds when present."""
    if not isinstance(schema, dict):
        raise bad_request(f"{path}: must be a JSON Schema object", param=path)
    if schema.get("type") != "object":
        raise bad_request(
            f"{path}.type: must be 'object', got {schema.get('type')!r}", param=f"{path}.type"
        )
    properties = schema.get("properties")
    if properties is not None and not (
        isinstance(properties, dict) and all(isinstance(v, dict) for v in properties.values())
    ):
        raise bad_request(
            f"{path}.properties: must map each parameter name to its schema",
            param=f"{path}.properties",
        )
    required = schema.get("required")
    if required is not None and not (
        isinstance(required, list) and all(isinstance(r, str) for r in required)
    ):
        raise bad_request(
            f"{path}.required: must be a list of parameter names", param=f"{path}.required"
        )
