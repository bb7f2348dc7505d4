"""Configuration declared once: a dataclass whose fields carry their flag's help (TRL's style),
from which the command line and its `ROLLTAP_*` variables are generated, so a flag, its help,
its variable and its default cannot drift apart. Precedence: flag, then variable, then default.
Used by `GatewayConfig` and by the bridge's `BridgeConfig` (the bridge may import the gateway).

Naming: a field's flag is its name without a `_s` unit suffix (`ttft_timeout_s`:
`--ttft-timeout`), its variable that flag in capitals (`ROLLTAP_TTFT_TIMEOUT`); `flag` and `env`
override them. A boolean field without an argparse action is a switch: one that defaults to on
is turned off by `--no-NAME` or `ROLLTAP_NAME=0`, one that defaults to off is turned on by
`--NAME` or `ROLLTAP_NAME=1`. An `append` field takes its variable comma separated.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

ENV_PREFIX = "ROLLTAP_"
_ON_WORDS, _OFF_WORDS = ("1", "true", "yes"), ("0", "false", "no")


def knob(
    help: str,
    metavar: str | None = None,
    *,
    group: str | None = None,
    flag: str | None = None,
    env: str | None = None,
    flag_default: Any = dataclasses.MISSING,
    to_field: Callable[[Any], Any] | None = None,
    show_default: bool | None = None,
    env_in_help: bool = False,
    **argparse_kwargs: Any,
) -> dict:
    """A field's flag, for `field(metadata=...)`. `flag_default` is the flag's default where the
    field's own differs in unit or meaning, and `to_field` turns the flag's value into the
    field's (--max-body-mb 32 is max_body_bytes 33554432). `show_default` None shows the
    default in the help unless it is empty; `env_in_help` says the help names the variable
    itself."""
    if metavar is not None:
        argparse_kwargs["metavar"] = metavar
    return {"help": help, "group": group, "flag": flag, "env": env,
            "flag_default": flag_default, "to_field": to_field, "show_default": show_default,
            "env_in_help": env_in_help, "argparse": argparse_kwargs}


def key_value(text: str) -> tuple[str, object]:
    """`KEY=VALUE`, VALUE read as JSON where it parses, else kept as text."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def flag_name(f: dataclasses.Field) -> str:
    if f.metadata["flag"]:
        return f.metadata["flag"]
    name = f.name.removesuffix("_s").replace("_", "-")
    return f"--no-{name}" if _is_switch(f) and f.default is True else f"--{name}"


def env_name(f: dataclasses.Field) -> str:
    name = f.metadata["env"] or (
        flag_name(f).removeprefix("--").removeprefix("no-").replace("-", "_").upper())
    return ENV_PREFIX + name


def add_arguments(
    cls: type, parser: argparse.ArgumentParser, required: tuple[str, ...] = (),
    secret: tuple[str, ...] = (),
) -> None:
    """One flag per field of `cls`, in its group, defaulting to its variable when that is set.
    Fields in `required` must come from a flag or the variable; `secret` ones never show."""
    groups: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        meta, env = f.metadata, env_name(f)
        kwargs: dict[str, Any] = {"dest": f.name, **meta["argparse"]}
        env_text = os.environ.get(env)
        if _is_switch(f):
            words = _OFF_WORDS if f.default else _ON_WORDS
            kwargs.update(action="store_true", default=(env_text or "").lower() in words)
            help_text = f"{meta['help']} (env {env}={words[0]})"
        else:
            default = _env_value(f, env_text) if env_text else _flag_default(f)
            show = meta["show_default"]
            if show is None:
                show = f.name not in secret + required and default not in (None, [], {}, "")
            help_text = meta["help"] if meta["env_in_help"] else f"{meta['help']} (env {env}" + (
                f"; default {_show(default)})" if show else ")")
            if f.name in required and not env_text:
                kwargs["required"] = True
            elif kwargs.get("action") != "append":  # argparse would append to a default list
                kwargs["default"] = default
        kwargs["help"] = help_text.replace("%", "%%")
        target = parser
        if meta["group"]:
            target = groups.setdefault(meta["group"], parser.add_argument_group(meta["group"]))
        target.add_argument(flag_name(f), **kwargs)


def values_from_args(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The fields of `cls` from flags parsed by a parser `add_arguments` filled; unset ones from
    their variables, then their defaults."""
    values = {}
    for f in dataclasses.fields(cls):
        value = getattr(args, f.name, None)
        if _is_switch(f):
            value = value != f.default  # the switch names what it changes
        elif value is None:
            env_text = os.environ.get(env_name(f))
            value = _env_value(f, env_text) if env_text else _flag_default(f)
        elif f.type == "dict":
            value = dict(value)
        if f.metadata["to_field"]:
            value = f.metadata["to_field"](value)
        values[f.name] = value
    return values


def _is_switch(f: dataclasses.Field) -> bool:
    return f.type == "bool" and "action" not in f.metadata["argparse"]


def _env_value(f: dataclasses.Field, text: str) -> Any:
    """A field's flag value from its variable: lists and KEY=VALUE pairs comma separated,
    booleans as 1/0/true/false."""
    if f.type == "dict":
        return dict(key_value(part) for part in text.split(",") if part)
    if f.type == "list[str]":
        return [part for part in text.split(",") if part]
    if f.type == "bool":
        return text.strip().lower() in (*_ON_WORDS, "on")
    convert = f.metadata["argparse"].get("type", str)
    try:
        return convert(text)
    except (TypeError, ValueError) as exc:
        raise SystemExit(f"error: {env_name(f)}={text!r}: {exc}") from None


def _flag_default(f: dataclasses.Field) -> Any:
    if f.metadata["flag_default"] is not dataclasses.MISSING:
        return f.metadata["flag_default"]
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _show(value: Any) -> str:
    return ",".join(map(str, value)) if isinstance(value, list) else str(value)
