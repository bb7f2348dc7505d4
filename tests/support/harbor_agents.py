"""A Harbor agent for tests: runs the task's instruction as a bash script in the environment,
as an agent would run the commands it chose (tests/support/forged_tasks.py writes them). It
calls no model: the gateway's rollout has no calls."""

from __future__ import annotations

from harbor.agents.base import BaseAgent
from harbor.environments.base import BaseEnvironment
from harbor.models.agent.context import AgentContext


class ShellAgent(BaseAgent):
    @staticmethod
    def name() -> str:
        return "rolltap-test-shell"

    def version(self) -> str:
        return "1.0.0"

    async def setup(self, environment: BaseEnvironment) -> None:
        pass

    async def run(self, instruction: str, environment: BaseEnvironment,
                  context: AgentContext) -> None:
        result = await environment.exec(instruction, timeout_sec=120)
        if result.return_code != 0:
            raise RuntimeError(f"the attempt's script failed: {result.stderr}")
