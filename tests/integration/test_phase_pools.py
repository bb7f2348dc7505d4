"""Phase pools with real sandboxes (against the STAND-IN admin API, tests/support/
stand_in_admin.py): a verifier runs in a verify slot only, so while it waits an agent of
another rollout gets the one agent slot. The verifier here waits for that other agent: if it
held the agent slot, neither could go on and both would score 0."""

from __future__ import annotations

import json
from pathlib import Path

from sandbox.backends.local import LocalBackend
from sandbox.pools import PhasePools
from sandbox.presets import Harness
from sandbox.runner import run_rollouts
from sandbox.tasks import Task, Timeouts, Verifier
from tests.support.stand_in_admin import ADMIN_KEY

AGENT = '''
import json, os, pathlib

def agent(*, prompt, base_url, api_key, model, workdir):
    shared = pathlib.Path(json.loads(prompt)["dir"])
    (shared / f"agent-{os.getpid()}").write_text("")
    pathlib.Path(workdir, "out.txt").write_text("ok")
'''


async def test_a_waiting_verifier_leaves_the_agent_slot_to_another_rollout(admin_api, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    agents = tmp_path / "agents"
    agents.mkdir()
    (agents / "pool_agent.py").write_text(AGENT)
    harness = Harness(preset="python", model="m", agent="pool_agent:agent",
                      pythonpath=(str(agents),))
    both = f"[ $(ls {shared} | grep -c agent) -ge 2 ]"
    verifier = Verifier(f"i=0; until {both} || [ $i -ge 300 ]; do sleep 0.1; i=$((i+1)); done; "
                        f"{both} && test -f out.txt", "binary", {})
    task = Task(id="pools", prompt=json.dumps({"dir": str(shared)}), files={},
                verifier=verifier, timeouts=Timeouts(agent_s=60, verifier_s=60, setup_s=30))
    pools = PhasePools(setup=1, agent=1, verify=1)
    report = await run_rollouts(
        [task], harness, gateway=admin_api.url, admin_key=ADMIN_KEY, group_size=2,
        concurrency=2, backend=LocalBackend(root=str(tmp_path / "sb"), isolation="none",
                                            use_cgroup=False, pools=pools))
    assert report.errors == []
    assert [r.reward for r in report.finished] == [1.0, 1.0], report.finished
    stats = pools.stats()
    assert {name: s.taken for name, s in stats.items()} == {"setup": 2, "agent": 2, "verify": 2}
    assert all(s.busy == 0 and s.waiting == 0 for s in stats.values())
    assert len(list(Path(shared).glob("agent-*"))) == 2
