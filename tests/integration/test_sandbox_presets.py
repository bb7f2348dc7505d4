"""Harness presets: what each one launches, and (where the npm harnesses are installed) that
the launch really reaches the given base URL with the rollout's key."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tomllib

import pytest
from aiohttp import web
from hypothesis import given
from hypothesis import strategies as st

from sandbox.backends.base import RolloutAccess, SandboxRequest
from sandbox.backends.local import LocalBackend
from sandbox.presets import (
    KEY_VAR,
    NPM_EXECUTABLES,
    PRESETS,
    Harness,
    LaunchContext,
    build_launch,
    check_harness,
    fill_template,
    harness_limits,
    harness_protocol,
)
from sandbox.tasks import Task, Timeouts, Verifier
from tests.support.harnesses import HARNESS_PACKAGES, require_harnesses

KEY = "rk-preset-key-42"
CTX = LaunchContext(prompt="Fix the bug, then say \"done\".", api_key=KEY,
                    openai_base_url="http://127.0.0.1:9000/v1",
                    anthropic_base_url="http://127.0.0.1:9000",
                    workdir="/sbx/work", home="/sbx/home")
NPM = sorted(NPM_EXECUTABLES)


@given(st.text(min_size=1).filter(lambda s: "\x00" not in s))
def test_template_keeps_prompt_one_argument(prompt):
    argv = fill_template("agent --ask {prompt} --url={base_url} -k {api_key}",
                         {"prompt": prompt, "base_url": "http://x/v1", "api_key": "k",
                          "model": "m", "workdir": "/w"})
    assert argv == ["agent", "--ask", prompt, "--url=http://x/v1", "-k", "k"]


def test_template_leaves_other_braces_alone():
    argv = fill_template("""tool --json '{"model": "{model}"}' {workdir}""",
                         {"prompt": "", "base_url": "", "api_key": "", "model": "tiny",
                          "workdir": "/w"})
    assert argv == ["tool", '--json', '{"model": "tiny"}', "/w"]


def test_python_preset():
    launch = build_launch(Harness(preset="python", model="tiny", agent="pkg.mod:run",
                                  pythonpath=("/agents",)), CTX)
    assert launch.argv[:4] == [sys.executable, "-I", "-m", "sandbox.agents.launch"]
    assert launch.argv[-1] == f"--prompt={CTX.prompt}"
    assert ["--path", "/agents"] == launch.argv[launch.argv.index("--path"):][:2]
    assert KEY not in " ".join(launch.argv)  # argv is visible to every user of the machine
    assert launch.env["OPENAI_API_KEY"] == launch.env[KEY_VAR] == KEY
    assert launch.env["OPENAI_BASE_URL"] == CTX.openai_base_url


def test_command_preset_anthropic():
    harness = Harness(preset="command", model="m", protocol="anthropic",
                      command="agent {base_url} {prompt}")
    launch = build_launch(harness, CTX)
    assert launch.argv == ["agent", CTX.anthropic_base_url, CTX.prompt]
    assert launch.env["ANTHROPIC_API_KEY"] == KEY and launch.protocol == "anthropic"


@pytest.mark.parametrize("preset", NPM)
def test_npm_presets(preset):
    launch = build_launch(Harness(preset=preset, model="tiny"), CTX)
    assert launch.argv[0] == NPM_EXECUTABLES[preset]
    assert launch.argv[-1] == CTX.prompt
    assert KEY not in " ".join(launch.argv)
    for name, content in launch.files.items():
        assert not name.startswith("/") and ".." not in name
        # Config files name the variable that holds the key, never the key itself.
        assert KEY.encode() not in content
        parsed = tomllib.loads(content.decode()) if name.endswith(".toml") else json.loads(content)
        assert parsed
    url = CTX.anthropic_base_url if preset == "claude-code" else CTX.openai_base_url
    assert launch.protocol == harness_protocol(Harness(preset=preset, model="tiny"))
    assert url in json.dumps(launch.env) or any(url.encode() in c for c in launch.files.values())
    assert KEY in launch.env.values()
    # Node reserves huge virtual memory: no address-space limit for the npm harnesses.
    assert harness_limits(Harness(preset=preset, model="tiny")).address_space_mb is None
    # Tool-using agents: their toolless calls are side calls, even with no agent turn beside.
    assert PRESETS[preset].side_calls == "toolless"


def test_python_and_command_agents_leave_side_calls_to_the_gateway():
    assert PRESETS["python"].side_calls == PRESETS["command"].side_calls == "auto"


def test_config_details():
    oc = build_launch(Harness(preset="opencode", model="tiny"), CTX)
    config = json.loads(oc.files[".config/opencode/opencode.json"])
    provider = config["provider"]["gw"]
    assert provider["options"] == {"baseURL": CTX.openai_base_url, "apiKey": f"{{env:{KEY_VAR}}}"}
    assert config["model"] == config["small_model"] == "gw/tiny"
    assert oc.env["OPENCODE_CONFIG"] == "/sbx/home/.config/opencode/opencode.json"

    codex = build_launch(Harness(preset="codex", model="tiny"), CTX)
    toml = tomllib.loads(codex.files[".codex/config.toml"].decode())
    assert toml["model_providers"]["gw"] == {
        "name": "rolltap gateway", "base_url": CTX.openai_base_url, "env_key": KEY_VAR,
        "wire_api": "responses"}
    assert toml["check_for_update_on_startup"] is False
    assert codex.env["CODEX_HOME"] == "/sbx/home/.codex"

    claude = build_launch(Harness(preset="claude-code", model="tiny", max_output_tokens=512), CTX)
    assert claude.env["ANTHROPIC_BASE_URL"] == CTX.anthropic_base_url
    assert claude.env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "512"
    assert claude.env["CLAUDE_CONFIG_DIR"] == "/sbx/home/.claude"

    qwen = build_launch(Harness(preset="qwen-code", model="tiny", max_output_tokens=64,
                                context_window=8192), CTX)
    generation = json.loads(qwen.files[".qwen/settings.json"])["model"]["generationConfig"]
    assert generation == {"samplingParams": {"max_tokens": 64}, "contextWindowSize": 8192}

    pi = build_launch(Harness(preset="pi", model="tiny"), CTX)
    models = json.loads(pi.files[".pi/agent/models.json"])
    assert models["providers"]["gw"]["apiKey"] == KEY_VAR
    assert models["providers"]["gw"]["models"][0]["id"] == "tiny"
    # Pi compacts past window - reserve; its default reserve (16384) would make every run on
    # a small window end in a summary call asking for more tokens than the window holds.
    small = build_launch(Harness(preset="pi", model="smol", context_window=8192), CTX)
    settings = json.loads(small.files[".pi/agent/settings.json"])
    assert settings["compaction"]["reserveTokens"] == 2048


@pytest.mark.parametrize(
    "harness",
    [
        Harness(preset="python", model="m"),
        Harness(preset="python", model="m", agent="no colon"),
        Harness(preset="command", model="m"),
        Harness(preset="command", model="m", command="   "),
        Harness(preset="command", model="m", command="unbalanced 'quote"),
        Harness(preset="claude-code", model="m", protocol="openai"),
        Harness(preset="nonesuch", model="m"),
    ],
)
def test_bad_harness_is_rejected_up_front(harness):
    with pytest.raises(ValueError):
        check_harness(harness)


def test_every_preset_has_help():
    assert set(PRESETS) == {"python", "command", *NPM}
    assert all(p.help for p in PRESETS.values())


# ---- the real npm harnesses, if installed -----------------------------------------------------

def harness_path(bin_dir) -> str:
    extra = os.environ.get("ROLLTAP_HARNESS_BIN_DIR", "")
    return os.pathsep.join(p for p in (extra, str(bin_dir), os.environ.get("PATH", "")) if p)


@pytest.mark.parametrize("preset", NPM)
async def test_real_harness_reaches_base_url_with_rollout_key(preset):
    """A stand-in model endpoint that refuses every request (400) and records who asked: the
    harness, started offline from its preset, must come to it with the rollout's key."""
    exe = shutil.which(NPM_EXECUTABLES[preset], path=harness_path(require_harnesses()))
    if exe is None:
        pytest.skip(f"{preset} is not installed (the suite installs {sorted(HARNESS_PACKAGES)}; "
                    "set ROLLTAP_HARNESS_BIN_DIR for others)")
    seen: list[tuple[str, str | None, str | None, object]] = []

    async def refuse(request: web.Request) -> web.Response:
        body = await request.read()
        model = json.loads(body).get("model") if body else None
        seen.append((request.path, request.headers.get("Authorization"),
                     request.headers.get("x-api-key"), model))
        return web.json_response({"error": {"message": "stand-in refuses",
                                            "type": "invalid_request_error"}}, status=400)

    app = web.Application(client_max_size=1 << 26)
    app.router.add_route("*", "/{tail:.*}", refuse)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        access = RolloutAccess("r", KEY, f"http://127.0.0.1:{port}/v1", f"http://127.0.0.1:{port}")
        task = Task(id="t", prompt="Say hi.", files={"README.md": b"hi\n"},
                    verifier=Verifier("true", "binary", {}),
                    timeouts=Timeouts(agent_s=120.0))
        harness = Harness(preset=preset, model="tiny", executable=exe)
        result = await LocalBackend().run(SandboxRequest(task, harness, access))
    finally:
        await runner.cleanup()
    posts = [s for s in seen if s[3] is not None]
    assert posts, (result.agent.stdout, result.agent.stderr)
    for path, bearer, x_api_key, model in posts:
        assert model == "tiny"
        assert (bearer == f"Bearer {KEY}") or (x_api_key == KEY)
        assert path.startswith("/v1/")
    assert result.status == "crashed"  # every model call was refused
