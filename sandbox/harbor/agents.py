"""Harbor agents that Harbor always installs from the network inside the sandbox (nvm, npm),
made to use a CLI that is already there: rolltap's bwrap environment can bind the project's
pinned CLIs in (`ro_paths`, `path`), and its sandbox reaches only the gateway, so an install
would fail. Where the CLI is not on PATH the agent installs as Harbor's own does.

The worker runs these in place of Harbor's agents of the same names (OFFLINE); they are
Harbor's classes otherwise, with the same name() and options.
"""

from __future__ import annotations

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


OFFLINE = {"opencode": f"{__name__}:OpenCode", "qwen-coder": f"{__name__}:QwenCode",
           "pi": f"{__name__}:Pi"}
