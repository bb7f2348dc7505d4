"""Harbor agents that Harbor always installs from the network inside the sandbox (nvm, npm,
uv), made to use what the project pinned instead: rolltap's bwrap environment can bind the
project's pinned CLIs (`.cache/npm`) and mini-swe-agent's wheels (`.cache/harbor-wheels`) in
(`ro_paths`, `path`), and its sandbox reaches only the gateway, so a network install would
fail. Where they are not in the sandbox the agent installs as Harbor's own does.

The worker runs these in place of Harbor's agents of the same names (OFFLINE); they are
Harbor's classes otherwise, with the same name() and options.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from harbor.agents.installed.codex import Codex as HarborCodex
from harbor.agents.installed.mini_swe_agent import MiniSweAgent as HarborMiniSweAgent
from harbor.agents.installed.opencode import OpenCode as HarborOpenCode
from harbor.agents.installed.pi import Pi as HarborPi
from harbor.agents.installed.qwen_code import QwenCode as HarborQwenCode
from harbor.environments.base import BaseEnvironment


class _UsesPinnedCli:
    CLI = ""

    async def install(self, environment: BaseEnvironment) -> None:
        found = await environment.exec(f"command -v {self.CLI}", timeout_sec=30)
        if found.return_code == 0:
            return
        await super().install(environment)  # type: ignore[misc]


class OpenCode(_UsesPinnedCli, HarborOpenCode):
    CLI = "opencode"


class QwenCode(_UsesPinnedCli, HarborQwenCode):
    CLI = "qwen"


class Pi(_UsesPinnedCli, HarborPi):
    CLI = "pi"

    def _build_custom_models_json(self, access, model_id):
        # Harbor writes the key as "$VAR"; the project's pinned pi (0.73.1) takes the bare
        # variable name there and would send "$VAR" itself as the key.
        config = super()._build_custom_models_json(access, model_id)
        for provider in (config or {}).get("providers", {}).values():
            if str(provider.get("apiKey", "")).startswith("$"):
                provider["apiKey"] = provider["apiKey"][1:]
        return config


REPO = Path(__file__).resolve().parents[2]
# Downloaded by `make install` (MSWEA_WHEELS in the Makefile); the sandbox reaches it where the
# environment binds it (`ro_paths`), at its own path.
MINI_SWE_AGENT_WHEELS = REPO / ".cache" / "harbor-wheels" / "mini-swe-agent"
MINI_SWE_AGENT_DEPENDENCIES = [
    line for line in (Path(__file__).parent / "mini-swe-agent.txt").read_text().splitlines()
    if line.strip() and not line.startswith("#")]
# Into a venv of the agent's home, on the PATH Harbor's run command sets ($HOME/.local/bin).
# pip says that `datasets` is missing (left out on purpose) and goes on.
OFFLINE_INSTALL = """set -eu
venv="$HOME/.local/mini-swe-agent"
python3 -m venv "$venv"
pip="$venv/bin/pip install -q --no-compile --disable-pip-version-check --no-index"
$pip --find-links {wheels} --no-deps mini-swe-agent
$pip --find-links {wheels} {dependencies}
mkdir -p "$HOME/.local/bin"
ln -sf "$venv/bin/mini-swe-agent" "$HOME/.local/bin/mini-swe-agent"
"$HOME/.local/bin/mini-swe-agent" --help >/dev/null
"""


class MiniSweAgent(HarborMiniSweAgent):
    """Harbor's mini-swe-agent, installed from the project's wheels when the sandbox has them
    (Harbor's own install fetches uv, a Python and the package from the network)."""

    async def install(self, environment: BaseEnvironment) -> None:
        wheels = shlex.quote(os.fspath(MINI_SWE_AGENT_WHEELS))
        found = await environment.exec(f"test -d {wheels}", timeout_sec=30)
        if found.return_code != 0:
            await super().install(environment)
            return
        # Raises with the command's output when it fails: the trial's setup failed.
        await self.exec_as_agent(environment, OFFLINE_INSTALL.format(
            wheels=wheels, dependencies=shlex.join(MINI_SWE_AGENT_DEPENDENCIES)))


# Codex's own `openai` provider opens the Responses API over a WebSocket first (codex 0.171:
# `GET /v1/responses` with an upgrade), which the gateway answers 405, and retries five times
# before it falls back to HTTP. A provider of rolltap's own says it has no WebSocket.
GATEWAY_PROVIDER = {"name": "rolltap gateway", "env_key": "OPENAI_API_KEY",
                    "wire_api": "responses", "supports_websockets": False}


class Codex(HarborCodex):
    """Harbor's codex, its model provider rolltap's gateway over HTTP only (Harbor sets the
    provider's base_url from OPENAI_BASE_URL, as for its own)."""

    def _load_base_config(self) -> dict:
        config = super()._load_base_config()
        if "model_provider" not in config:
            config["model_provider"] = "rolltap"
            config.setdefault("model_providers", {})["rolltap"] = dict(GATEWAY_PROVIDER)
        return config


OFFLINE = {"codex": f"{__name__}:Codex", "opencode": f"{__name__}:OpenCode",
           "qwen-coder": f"{__name__}:QwenCode", "pi": f"{__name__}:Pi",
           "mini-swe-agent": f"{__name__}:MiniSweAgent"}
