"""Preflight: `rolltap rollouts` and `rolltap bridge`, pointed at something that is not there
or will not have them, stop before any work with one readable line, against the real gateway,
vLLM and Postgres of the test session."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from hypothesis import given
from hypothesis import strategies as st

from sandbox.preflight import model_problem
from tests.support.gateway import ADMIN_KEY, REPO, free_port
from trainer_bridge import preflight
from trainer_bridge.preflight import checked_pair, shape_problem

# A hang guard only: a preflight answers in seconds, these never come near it.
GUARD_S = 120


def _one_line(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1, proc.stderr
    return lines[0]


def _rollouts(gateway_url: str, admin_key: str, model: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "sandbox.cli", str(REPO / "examples/tasks/tasks.jsonl"),
            "--harness", "python", "--agent", "sandbox.agents.scripted:run", "--task",
            "fizzbuzz", "--group-size", "2", "--gateway", gateway_url, "--model", model]
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=GUARD_S,
                          env={**os.environ, "ROLLTAP_ADMIN_KEY": admin_key})


def test_runner_against_a_dead_gateway(vllm_server):
    line = _one_line(_rollouts(f"http://127.0.0.1:{free_port()}", ADMIN_KEY, vllm_server.model))
    assert "cannot reach the gateway" in line and "--gateway" in line


def test_runner_with_a_wrong_admin_key(gateway, vllm_server):
    before = gateway.admin.get("/admin/metrics").status_code  # the key the gateway takes
    line = _one_line(_rollouts(gateway.url, "not-the-admin-key", vllm_server.model))
    assert before == 200
    assert "refused the admin key" in line and "ROLLTAP_ADMIN_KEY" in line


def test_runner_asking_for_a_model_the_engine_does_not_serve(gateway, vllm_server):
    line = _one_line(_rollouts(gateway.url, ADMIN_KEY, "no-such-model"))
    assert "does not serve model 'no-such-model'" in line
    assert repr(vllm_server.model) in line  # what it does serve


def test_runner_preflight_passes_a_ready_gateway(gateway, vllm_server):
    import asyncio

    from sandbox.preflight import check_gateway

    asyncio.run(check_gateway(gateway.url, ADMIN_KEY, vllm_server.model))


def _bridge(model_dir, vllm_url: str, gateway_url: str, database_url: str,
            admin_key: str = ADMIN_KEY) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "trainer_bridge.cli", "bridge", "--model", str(model_dir),
            "--vllm", vllm_url, "--gateway", gateway_url, "--database-url", database_url,
            "--max-steps", "1"]
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=GUARD_S,
                          env={**os.environ, "ROLLTAP_ADMIN_KEY": admin_key})


def test_bridge_against_a_dead_gateway(vllm_server, database_url):
    line = _one_line(_bridge(vllm_server.model_dir, vllm_server.url,
                             f"http://127.0.0.1:{free_port()}", database_url))
    assert "cannot reach the gateway" in line and "--gateway" in line


def test_bridge_with_a_wrong_admin_key(gateway, vllm_server, database_url):
    line = _one_line(_bridge(vllm_server.model_dir, vllm_server.url, gateway.url, database_url,
                             admin_key="not-the-admin-key"))
    assert "refused the admin key" in line


def test_bridge_against_a_dead_vllm(gateway, vllm_server, database_url):
    line = _one_line(_bridge(vllm_server.model_dir, f"http://127.0.0.1:{free_port()}",
                             gateway.url, database_url))
    assert "cannot reach vLLM" in line and "--vllm" in line


def test_bridge_training_a_model_the_engine_does_not_serve(gateway, vllm_server, database_url,
                                                           tmp_path):
    other = tmp_path / "other-model"
    shutil.copytree(vllm_server.model_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["hidden_size"] *= 2
    (other / "config.json").write_text(json.dumps(config))
    line = _one_line(_bridge(other, vllm_server.url, gateway.url, database_url))
    assert f"serves {vllm_server.model_dir}" in line and "hidden_size" in line


def test_bridge_against_an_unreachable_database(gateway, vllm_server):
    line = _one_line(_bridge(vllm_server.model_dir, vllm_server.url, gateway.url,
                             f"postgresql://postgres:secret@127.0.0.1:{free_port()}/rolltap"))
    assert "cannot connect to the database at postgresql://127.0.0.1:" in line
    assert "secret" not in line  # the password is not shown


@given(st.text(min_size=1), st.lists(st.text(min_size=1), max_size=3),
       st.lists(st.text(min_size=1), max_size=2))
def test_a_model_problem_exactly_when_no_replica_serves_the_model(model, served, upstreams):
    problem = model_problem("http://gw", model, served, upstreams)
    assert (problem is None) == (model in served)
    if problem is not None and served:
        assert all(repr(name) in problem for name in served)  # what to ask for instead


@given(st.text(min_size=1), st.text(min_size=1), st.lists(st.text(min_size=1), max_size=3))
def test_a_harbor_agents_provider_prefix_is_not_part_of_the_served_name(provider, name, served):
    model = f"{provider}/{name}"
    problem = model_problem("http://gw", model, served, [], provider_prefix=True)
    assert (problem is None) == (model in served or model.partition("/")[2] in served)
    # Other harnesses send the name as given: the prefix counts there.
    assert model_problem("http://gw", model, [model.partition("/")[2]], []) is not None


_SHAPE = st.fixed_dictionaries({name: st.integers(1, 4) for name in preflight.SHAPE_FIELDS})


@given(_SHAPE, _SHAPE)
def test_a_shape_problem_exactly_when_a_weight_shape_differs(served, trained):
    problem = shape_problem("http://v", "/served", "/trained", served, trained)
    assert (problem is None) == (served == trained)
    assert shape_problem("http://v", "/served", "/trained", None, trained) is None


@given(st.sampled_from(["1.16.0", "1.17.0", None]),
       st.sampled_from(["0.32.0", "0.32.0+cpu", "0.32.1", "0.31.0", None]))
def test_only_the_checked_pair_silences_trls_vllm_warning(trl, vllm):
    expected = trl == "1.16.0" and vllm in ("0.32.0", "0.32.0+cpu")
    assert checked_pair(trl, vllm) is expected


def test_bridge_start_shows_no_vllm_version_warning(tmp_path):
    """The installed pair is the checked one (pyproject pins both): TRL's own import warns
    about the vLLM version, the bridge's start (through `rolltap`, TRL imported) does not."""
    plain = subprocess.run(
        [sys.executable, "-c", "import trl.experimental.async_grpo.async_grpo_trainer"],
        cwd=REPO, capture_output=True, text=True, timeout=GUARD_S)
    assert "TRL currently supports vLLM" in plain.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "core.cli", "bridge", "--model", str(tmp_path), "--vllm",
         "http://127.0.0.1:1", "--gateway", "http://127.0.0.1:1", "--max-steps", "1",
         "--print-config"], cwd=REPO, capture_output=True, text=True, timeout=GUARD_S)
    assert proc.returncode == 0, proc.stderr
    assert "TRL currently supports vLLM" not in proc.stderr
