"""`rolltap export`: rollouts recorded from the real tiny vLLM through the real gateway, exported
by the real CLI and read back with Hugging Face `datasets`. Token rows equal /traces exactly;
message rows rebuild the conversation; the filters select what they say."""

from __future__ import annotations

import json
import subprocess
import sys

import anthropic
import datasets
import openai
import pytest

from stack.export import message_row
from tests.support.gateway import REPO, GatewayProcess
from tests.support.postgres import fresh_database
from tests.support.vllm import PICK_COLOR_TOOL
from trainer_bridge.advantages import group_advantages


@pytest.fixture(scope="module")
def store(vllm_server, tmp_path_factory):
    dsn, drop = fresh_database("rolltap_export")
    gw = GatewayProcess([vllm_server.url], dsn,
                        log_path=tmp_path_factory.mktemp("export") / "gateway.log").start()
    yield gw, dsn
    gw.stop()
    drop()


def _chat_rollout(gw, model: str, task: str, group: str, reward) -> tuple[str, list[dict]]:
    """A two-turn chat conversation with tools; returns the rollout id and the conversation the
    engine saw last (its last request's messages plus the reply)."""
    rollout = gw.new_rollout(task_id=task, group_id=group)
    client = openai.OpenAI(base_url=rollout["openai_base_url"], api_key=rollout["api_key"])
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": f"Task {task}: say hi."}]
    for turn in range(2):
        reply = client.chat.completions.create(
            model=model, messages=messages, tools=[PICK_COLOR_TOOL], max_tokens=10,
        ).choices[0].message
        messages.append({"role": "assistant", "content": reply.content or ""})
        if turn == 0:
            messages.append({"role": "user", "content": "Once more."})
    assert gw.finish(rollout["rollout_id"], reward).status_code == 200
    return rollout["rollout_id"], messages


@pytest.fixture(scope="module")
def recorded(store, vllm_server):
    gw, _ = store
    model = vllm_server.model
    a, conv_a = _chat_rollout(gw, model, "t1", "g", 1.0)
    b, conv_b = _chat_rollout(gw, model, "t1", "g", 0.0)
    c, conv_c = _chat_rollout(gw, model, "t2", "h", None)
    # Anthropic Messages: the export shows the conversation in OpenAI chat form.
    rollout = gw.new_rollout(task_id="t3", group_id="k")
    msg = anthropic.Anthropic(base_url=rollout["anthropic_base_url"],
                              api_key=rollout["api_key"]).messages.create(
        model=model, max_tokens=8, system="Be brief.",
        messages=[{"role": "user", "content": "Hello there"}])
    assert gw.finish(rollout["rollout_id"], 0.5).status_code == 200
    failed = gw.new_rollout(task_id="t1", group_id="g")
    assert gw.finish(failed["rollout_id"], None, status="failed").status_code == 200
    return {"a": (a, conv_a), "b": (b, conv_b), "c": (c, conv_c),
            "anthropic": (rollout["rollout_id"], msg), "failed": failed["rollout_id"]}


def _export(dsn: str, out, *flags: str) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "core.cli", "export", str(out), "--database-url", dsn, *flags],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result


def _load(path) -> datasets.Dataset:
    kind = "parquet" if path.suffix == ".parquet" else "json"
    return datasets.load_dataset(kind, data_files={"train": str(path)}, split="train")


def test_token_rows_equal_traces_exactly(store, recorded, tmp_path):
    gw, dsn = store
    result = _export(dsn, tmp_path)
    assert "rollout" in result.stderr  # the progress bar
    rows = _load(tmp_path / "tokens.parquet")
    by_rollout: dict[str, list[dict]] = {}
    for row in rows:
        by_rollout.setdefault(row["rollout_id"], []).append(row)
    ids = {recorded[k][0] for k in ("a", "b", "c", "anthropic")}
    assert set(by_rollout) == ids  # the failed rollout made no calls: no sequences
    rewards = {recorded["a"][0]: 1.0, recorded["b"][0]: 0.0}
    expected_adv = dict(zip([recorded["a"][0], recorded["b"][0]],
                            group_advantages([1.0, 0.0])))
    for rid in ids:
        traces = gw.admin.get(f"/admin/rollouts/{rid}/traces").json()["sequences"]
        got = sorted(by_rollout[rid], key=lambda r: r["sequence"])
        assert len(got) == len(traces)
        for row, seq in zip(got, traces):
            for field in ("input_ids", "loss_mask", "logprobs", "versions"):
                assert row[field] == seq[field], (rid, field)
            assert (row["cause"], row["auxiliary"], row["excluded"]) == (
                seq["cause"], seq["auxiliary"], seq["excluded"])
            if rid in rewards:
                assert row["reward"] == rewards[rid] and row["group_id"] == "g"
                assert row["advantage"] == pytest.approx(expected_adv[rid])
    c_rows = by_rollout[recorded["c"][0]]
    assert all(r["reward"] is None and r["advantage"] == 0.0 for r in c_rows)
    # pyarrow reads the same file directly, with the declared types.
    import pyarrow.parquet as pq

    table = pq.read_table(tmp_path / "tokens.parquet")
    assert str(table.schema.field("logprobs").type) == "list<element: float>"
    assert table.num_rows == len(rows)


def test_message_rows_rebuild_the_conversation(store, recorded, tmp_path):
    gw, dsn = store
    _export(dsn, tmp_path, "--grain", "messages")
    assert not (tmp_path / "tokens.parquet").exists()
    rows = {r["rollout_id"]: r for r in _load(tmp_path / "messages.parquet")}
    for key in ("a", "b", "c"):
        rid, conversation = recorded[key]
        row = rows[rid]
        assert row["messages"] == [message_row(m) for m in conversation]
        tools = json.loads(row["tools"])
        assert [t["function"]["name"] for t in tools] == ["pick_color"]
        calls = gw.calls(rid)
        assert row["call_id"] == calls[-1]["call_id"]
    rid, reply = recorded["anthropic"]
    msgs = rows[rid]["messages"]
    assert [(m["role"], m["content"]) for m in msgs[:2]] == [
        ("system", "Be brief."), ("user", "Hello there")]
    assert msgs[2]["role"] == "assistant"
    assert msgs[2]["content"] == "".join(b.text for b in reply.content if b.type == "text")
    assert recorded["failed"] not in rows  # no calls, nothing to learn from


def test_filters_and_jsonl(store, recorded, tmp_path):
    _, dsn = store
    _export(dsn, tmp_path / "good", "--min-reward", "0.5", "--format", "jsonl")
    good = _load(tmp_path / "good" / "messages.jsonl")
    assert {r["rollout_id"] for r in good} == {recorded["a"][0], recorded["anthropic"][0]}
    tokens = _load(tmp_path / "good" / "tokens.jsonl")
    assert {r["rollout_id"] for r in tokens} == {recorded["a"][0], recorded["anthropic"][0]}
    _export(dsn, tmp_path / "t1", "--task", "t1", "--status", "finished")
    t1 = _load(tmp_path / "t1" / "messages.parquet")
    assert {r["rollout_id"] for r in t1} == {recorded["a"][0], recorded["b"][0]}
    _export(dsn, tmp_path / "later", "--since", "2999-01-01")
    import pyarrow.parquet as pq

    assert pq.read_table(tmp_path / "later" / "tokens.parquet").num_rows == 0
    bad = subprocess.run([sys.executable, "-m", "core.cli", "export", str(tmp_path / "x"),
                          "--database-url", dsn, "--since", "yesterday"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr and "since" in bad.stderr

