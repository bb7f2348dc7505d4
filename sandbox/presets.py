"""Harness presets: how to start a harness headless inside a sandbox, pointed at the gateway.

`build_launch` is pure: from the harness choice and the sandbox's paths and gateway access it
derives the argv, the environment additions and the config files (relative to the sandbox's
HOME). Every npm harness gets its config in the fresh HOME, telemetry and update checks off,
and (through the sandbox's base environment) an npm registry address where nothing listens.

Each preset uses one protocol, and with it one of the gateway's base URLs: `openai`
(`…/v1`, chat completions or Responses) or `anthropic` (the server root, Messages).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import msgspec

from sandbox.limits import Limits

Protocol = Literal["openai", "anthropic"]

# The environment variable that carries the rollout's key to harnesses whose config names a
# variable rather than the key itself (OpenCode, Codex, Pi): the key stays out of files.
KEY_VAR = "ROLLTAP_API_KEY"


class Harness(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    preset: str
    model: str
    agent: str | None = None  # python: "package.module:function"
    command: str | None = None  # command: argv template with {prompt} {base_url} ... fields
    protocol: Protocol | None = None  # python/command; the npm presets have their own
    executable: str | None = None  # npm presets: the CLI to run (default: its usual name)
    extra_args: tuple[str, ...] = ()
    pythonpath: tuple[str, ...] = ()  # python: directories the agent module is imported from
    context_window: int = 32768
    max_output_tokens: int = 4096
    limits: Limits | None = None


class LaunchContext(msgspec.Struct, frozen=True):
    prompt: str
    api_key: str
    openai_base_url: str
    anthropic_base_url: str
    workdir: str
    home: str


class Launch(msgspec.Struct, frozen=True):
    argv: list[str]
    env: dict[str, str]
    files: dict[str, bytes]  # relative to HOME
    protocol: Protocol


@dataclass(frozen=True)
class Preset:
    protocol: Protocol | None  # None: chosen per harness (python, command), default openai
    build: Callable[[Harness, LaunchContext], Launch]
    limits: Limits
    help: str
    # What the gateway takes a toolless call for (POST /admin/rollouts `side_calls`): the npm
    # harnesses are tool-using agents, so their toolless calls are side calls (titles,
    # summaries), even in a rollout whose agent never got to its first turn.
    side_calls: str = "auto"


def base_url(ctx: LaunchContext, protocol: Protocol) -> str:
    return ctx.openai_base_url if protocol == "openai" else ctx.anthropic_base_url


def protocol_env(ctx: LaunchContext, protocol: Protocol, model: str) -> dict[str, str]:
    """The conventional variables of `protocol` plus rolltap's own, for agents that read env."""
    url = base_url(ctx, protocol)
    prefix = "OPENAI" if protocol == "openai" else "ANTHROPIC"
    return {
        f"{prefix}_BASE_URL": url,
        f"{prefix}_API_KEY": ctx.api_key,
        "ROLLTAP_BASE_URL": url,
        KEY_VAR: ctx.api_key,
        "ROLLTAP_MODEL": model,
    }


def _json(obj: object) -> bytes:
    return json.dumps(obj, indent=2).encode()


def _toml_str(value: str) -> str:
    # A TOML basic string is a JSON string minus a few escapes JSON never emits for these.
    return json.dumps(value)


# ---- python and command ---------------------------------------------------------------------


def _python(h: Harness, ctx: LaunchContext) -> Launch:
    protocol = harness_protocol(h)
    argv = [sys.executable, "-I", "-m", "sandbox.agents.launch", "--agent", h.agent,
            "--workdir", ctx.workdir, "--model", h.model, "--protocol", protocol,
            "--base-url", base_url(ctx, protocol)]
    for path in h.pythonpath:
        argv += ["--path", path]
    argv += [*h.extra_args, f"--prompt={ctx.prompt}"]
    return Launch(argv, protocol_env(ctx, protocol, h.model), {}, protocol)


_FIELD = re.compile(r"\{(prompt|base_url|api_key|model|workdir)\}")


def fill_template(template: str, values: dict[str, str]) -> list[str]:
    """Split `template` like a shell would, then substitute the fields inside each word, so a
    prompt with spaces or quotes stays one argument and nothing is ever run by a shell."""
    return [_FIELD.sub(lambda m: values[m.group(1)], word) for word in shlex.split(template)]


def _command(h: Harness, ctx: LaunchContext) -> Launch:
    protocol = harness_protocol(h)
    values = {"prompt": ctx.prompt, "base_url": base_url(ctx, protocol), "api_key": ctx.api_key,
              "model": h.model, "workdir": ctx.workdir}
    assert h.command is not None  # the command preset is refused without one (check_harness)
    argv = fill_template(h.command, values) + list(h.extra_args)
    return Launch(argv, protocol_env(ctx, protocol, h.model), {}, protocol)


# ---- npm harnesses --------------------------------------------------------------------------


def _opencode(h: Harness, ctx: LaunchContext) -> Launch:
    config = {
        "provider": {
            "gw": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "rolltap gateway",
                "options": {"baseURL": ctx.openai_base_url, "apiKey": f"{{env:{KEY_VAR}}}"},
                "models": {
                    h.model: {
                        "name": h.model,
                        "limit": {"context": h.context_window, "output": h.max_output_tokens},
                    }
                },
            }
        },
        "model": f"gw/{h.model}",
        "small_model": f"gw/{h.model}",
        "autoupdate": False,
        "share": "disabled",
    }
    path = ".config/opencode/opencode.json"
    env = {
        KEY_VAR: ctx.api_key,
        "OPENCODE_CONFIG": f"{ctx.home}/{path}",
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1",
    }
    exe = h.executable or NPM_EXECUTABLES["opencode"]
    argv = [exe, "run", "--pure", "-m", f"gw/{h.model}", *h.extra_args, ctx.prompt]
    return Launch(argv, env, {path: _json(config)}, "openai")


def _codex(h: Harness, ctx: LaunchContext) -> Launch:
    config = "\n".join([
        f"model = {_toml_str(h.model)}",
        'model_provider = "gw"',
        'approval_policy = "never"',
        # rolltap's sandbox is the boundary; Codex's own (bubblewrap) needs user namespaces
        # that containers often lack, and its exec default, read-only, forbids every edit.
        'sandbox_mode = "danger-full-access"',
        f"model_context_window = {h.context_window}",
        "check_for_update_on_startup = false",
        "",
        "[model_providers.gw]",
        'name = "rolltap gateway"',
        f"base_url = {_toml_str(ctx.openai_base_url)}",
        f"env_key = {_toml_str(KEY_VAR)}",
        'wire_api = "responses"',
        "",
        "[analytics]",
        "enabled = false",
        "",
        "[feedback]",
        "enabled = false",
        "",
        "[features]",
        "apps = false",
        "plugins = false",
        "",
    ])
    env = {KEY_VAR: ctx.api_key, "CODEX_HOME": f"{ctx.home}/.codex"}
    exe = h.executable or NPM_EXECUTABLES["codex"]
    argv = [exe, "exec", "--skip-git-repo-check", "-C", ctx.workdir, *h.extra_args, ctx.prompt]
    return Launch(argv, env, {".codex/config.toml": config.encode()}, "openai")


def _claude_code(h: Harness, ctx: LaunchContext) -> Launch:
    env = {
        "ANTHROPIC_BASE_URL": ctx.anthropic_base_url,
        "ANTHROPIC_API_KEY": ctx.api_key,
        "ANTHROPIC_MODEL": h.model,
        "ANTHROPIC_SMALL_FAST_MODEL": h.model,
        "CLAUDE_CONFIG_DIR": f"{ctx.home}/.claude",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(h.max_output_tokens),
        # Claude Code refuses to skip its permission prompts as root unless told it runs in a
        # sandbox, which it does; without skipping, --print denies every edit and command.
        "IS_SANDBOX": "1",
    }
    exe = h.executable or NPM_EXECUTABLES["claude-code"]
    # "--" ends the options: its --tools takes any number of values, and a prompt may start
    # with a dash.
    argv = [exe, "--print", "--dangerously-skip-permissions", "--model", h.model, *h.extra_args,
            "--", ctx.prompt]
    return Launch(argv, env, {}, "anthropic")


def _qwen_code(h: Harness, ctx: LaunchContext) -> Launch:
    settings = {
        "$version": 3,
        # Qwen Code sends exactly its samplingParams when they are set; the gateway pins the
        # rest of sampling to the training policy anyway.
        "model": {"generationConfig": {"samplingParams": {"max_tokens": h.max_output_tokens},
                                       "contextWindowSize": h.context_window}},
        "general": {"enableAutoUpdate": False},
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
    }
    env = {
        "OPENAI_BASE_URL": ctx.openai_base_url,
        "OPENAI_API_KEY": ctx.api_key,
        "OPENAI_MODEL": h.model,
    }
    exe = h.executable or NPM_EXECUTABLES["qwen-code"]
    # Headless Qwen Code refuses tools that need approval; the sandbox is the boundary.
    argv = [exe, "--auth-type", "openai", "--approval-mode", "yolo", "-m", h.model,
            *h.extra_args, ctx.prompt]
    return Launch(argv, env, {".qwen/settings.json": _json(settings)}, "openai")


def _pi(h: Harness, ctx: LaunchContext) -> Launch:
    models = {
        "providers": {
            "gw": {
                "baseUrl": ctx.openai_base_url,
                "api": "openai-completions",
                "apiKey": KEY_VAR,
                # vLLM's chat template takes a system message, not OpenAI's developer role.
                "compat": {"supportsDeveloperRole": False, "supportsReasoningEffort": False},
                "models": [{
                    "id": h.model,
                    "contextWindow": h.context_window,
                    "maxTokens": h.max_output_tokens,
                }],
            }
        }
    }
    agent_dir = ".pi/agent"
    env = {
        KEY_VAR: ctx.api_key,
        "PI_CODING_AGENT_DIR": f"{ctx.home}/{agent_dir}",
        "PI_OFFLINE": "1",
        "PI_SKIP_VERSION_CHECK": "1",
    }
    exe = h.executable or NPM_EXECUTABLES["pi"]
    argv = [exe, "--print", "--offline", "--no-session", "--provider", "gw", "--model", h.model,
            *h.extra_args, ctx.prompt]
    files = {
        f"{agent_dir}/models.json": _json(models),
        # Pi compacts once the context passes its window minus `reserveTokens` (default 16384)
        # and then asks for a summary of 0.8 x reserveTokens: with a window of 16k or less
        # every run would end in a summary call the engine rejects.
        f"{agent_dir}/settings.json": _json({
            "enableInstallTelemetry": False,
            "compaction": {"reserveTokens": min(16384, h.context_window // 4)},
        }),
    }
    return Launch(argv, env, files, "openai")


NPM_EXECUTABLES = {
    "opencode": "opencode",
    "codex": "codex",
    "claude-code": "claude",
    "qwen-code": "qwen",
    "pi": "pi",
}

# Node reserves far more virtual address space than it uses (V8's heap cage, wasm), so an
# address-space rlimit breaks it; the wall-clock timeout and the process cap bound it instead.
NODE_LIMITS = Limits(address_space_mb=None, max_procs=512)

PRESETS: dict[str, Preset] = {
    "python": Preset(None, _python, Limits(),
                     "an agent function 'module:function', run by sandbox.agents.launch"),
    "command": Preset(None, _command, Limits(),
                      "any CLI, from a template with {prompt} {base_url} {api_key} {model} "
                      "{workdir}"),
    "opencode": Preset("openai", _opencode, NODE_LIMITS,
                       "OpenCode (opencode-ai): `opencode run`, chat completions",
                       side_calls="toolless"),
    "codex": Preset("openai", _codex, NODE_LIMITS,
                    "Codex (@openai/codex): `codex exec`, Responses API",
                    side_calls="toolless"),
    "claude-code": Preset("anthropic", _claude_code, NODE_LIMITS,
                          "Claude Code (@anthropic-ai/claude-code): `claude --print`, Messages",
                          side_calls="toolless"),
    "qwen-code": Preset("openai", _qwen_code, NODE_LIMITS,
                        "Qwen Code (@qwen-code/qwen-code): `qwen PROMPT`, chat completions",
                        side_calls="toolless"),
    "pi": Preset("openai", _pi, NODE_LIMITS,
                 "Pi (@mariozechner/pi-coding-agent): `pi --print`, chat completions",
                 side_calls="toolless"),
}


def preset_for(harness: Harness) -> Preset:
    try:
        return PRESETS[harness.preset]
    except KeyError:
        raise ValueError(
            f"unknown harness preset {harness.preset!r}; known: {', '.join(PRESETS)}"
        ) from None


def side_calls_for(harness: Harness) -> str:
    """What the gateway takes the rollout's toolless calls for (POST /admin/rollouts
    `side_calls`). A Harbor agent (`harbor:AGENT`) is no preset and may be any agent: the
    gateway decides by the rollout's own calls."""
    if harness.preset.startswith("harbor:"):
        return "auto"
    return preset_for(harness).side_calls


def harness_protocol(harness: Harness) -> Protocol:
    """The protocol, and so the gateway base URL, the harness uses."""
    fixed = preset_for(harness).protocol
    if fixed is None:
        return harness.protocol or "openai"
    if harness.protocol not in (None, fixed):
        raise ValueError(f"{harness.preset} speaks {fixed}, not {harness.protocol}")
    return fixed


def check_harness(harness: Harness) -> None:
    """Raise ValueError for a harness that cannot be launched, before any rollout starts."""
    harness_protocol(harness)
    if harness.preset == "python" and not re.fullmatch(r"[\w.]+:\w+", harness.agent or ""):
        raise ValueError("the python preset needs --agent as 'package.module:function'")
    if harness.preset == "command":
        try:
            words = shlex.split(harness.command or "")
        except ValueError as exc:
            raise ValueError(f"--command cannot be split into words: {exc}") from None
        if not words:
            raise ValueError("the command preset needs --command")


def executable(harness: Harness) -> str:
    """The program the harness starts (to check it exists before starting)."""
    if harness.preset == "python":
        return sys.executable
    if harness.preset == "command":
        return shlex.split(harness.command or "")[0]
    return harness.executable or NPM_EXECUTABLES[harness.preset]


def install_paths(harness: Harness, path: str) -> list[str]:
    """Host directories a confined harness must read besides the system and rolltap's python:
    the `python` preset's import directories; the `node_modules` tree an npm harness's
    executable lives in; the directory of a command's program. `path`: the sandbox's PATH."""
    if harness.preset == "python":
        return list(harness.pythonpath)
    found = shutil.which(executable(harness), path=path)
    if found is None:
        return []
    out = []
    for candidate in (os.path.abspath(found), os.path.realpath(found)):
        parts = candidate.split(os.sep)
        if harness.preset != "command" and "node_modules" in parts:
            out.append(os.sep.join(parts[: parts.index("node_modules") + 1]))
        else:
            out.append(os.path.dirname(candidate))
    return out


def harness_limits(harness: Harness) -> Limits:
    return harness.limits or preset_for(harness).limits


def build_launch(harness: Harness, ctx: LaunchContext) -> Launch:
    check_harness(harness)
    return preset_for(harness).build(harness, ctx)
