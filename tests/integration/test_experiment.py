"""The learning experiment's pieces on the tiny model (real vLLM): the seeded evaluation samples
and grades every (prompt, sample), the grader tells structural failures from logic ones, and a
half-done run resumes (a finished part is never rerun, the part that stopped runs again). It
never asserts that anything learns: the tiny model is random."""

from __future__ import annotations

import json

import msgspec
import pytest

from stack.experiment import driver
from stack.experiment.check import STRUCTURAL, grade
from stack.experiment.evaluation import Evaluation, evaluate, sample_seed
from stack.experiment.parts import Config
from stack.experiment.tasks import generate


def test_grader_tells_structure_from_logic():
    cases = [[[2], 4], [[3], 6]]
    block = "```python\n{}\n```".format
    assert grade(block("def f(x):\n    return 2 * x"), "f", cases).verdict == "pass"
    assert grade(block("def f(x):\n    return x + 2"), "f", cases).passed == 1
    assert grade(block("def f(x):\n    return x + 2"), "f", cases).verdict == "logic"
    assert grade(block("def g(x):\n    return 2 * x"), "f", cases).verdict == "wrong_name"
    assert grade(block("def f(x) return"), "f", cases).verdict == "syntax"
    assert grade(block("print('hi')\ndef f(x):\n    return 2 * x"), "f",
                 cases).verdict == "io_at_import"
    assert grade(block("n = input()\ndef f(x):\n    return 2 * x"), "f",
                 cases).verdict == "import_error"
    assert grade(block("while True:\n    pass"), "f", cases, timeout_s=2).verdict == "timeout"
    assert grade("no code at all", "f", cases).verdict == "no_code"


def test_seeded_evaluation_and_a_resumed_run(vllm_server, tmp_path):
    tasks = (generate(0, "heldout", ["affine", "wrap"], 1)
             + generate(0, "heldout", ["last_even"], 1, ood=True))
    results, runs = tmp_path / "results", []

    def evaluated(ctx):
        ev = evaluate("A", tasks, upstream=vllm_server.url, model=vllm_server.model, samples=2,
                      seed_base=5, temperature=1.0, concurrency=2, log=ctx.log)
        return {"arm": ev}

    def stops(ctx):
        runs.append("stops")
        raise RuntimeError("stopped midway")

    steps = [("eval", evaluated), ("second", stops)]
    with pytest.raises(RuntimeError, match="stopped midway"):
        driver.run(Config(), steps, results=results, workdir=tmp_path / "work",
                   model_dir=vllm_server.model_dir, seeds=[0])
    record = json.loads((results / "eval.json").read_text())
    assert not (results / "second.json").exists()
    assert record["config"]["eval_samples"] == Config().eval_samples and record["commit"]
    arm = msgspec.convert(record["result"]["arm"], Evaluation)
    assert set(arm.samples) == {t["id"] for t in tasks} and arm.label == "A"
    for task in tasks:
        got = arm.samples[task["id"]]
        assert [s.seed for s in got] == [sample_seed(5, task["id"], j) for j in range(2)]
        for s in got:  # a random model: whatever it wrote, it was graded
            assert s.verdict in {"pass", "logic", *STRUCTURAL} and s.total == 4
    assert arm.ood == [tasks[-1]["id"]] and len(arm.outcomes()) == 2

    leftover = tmp_path / "work" / "second" / "state.jsonl"  # what the stopped part left
    leftover.parent.mkdir(parents=True)
    leftover.write_text("{}\n")
    ran = []
    resumed = [("eval", lambda ctx: pytest.fail("a finished part ran again")),
               ("second", lambda ctx: ran.append("second") or {"ok": True})]
    done = driver.run(Config(), resumed, results=results, workdir=tmp_path / "work",
                      model_dir=vllm_server.model_dir, seeds=[0])
    assert ran == ["second"] and set(done) == {"eval", "second"} and not leftover.exists()
    assert json.loads((results / "second.json").read_text())["result"] == {"ok": True}


def test_two_call_agent_shows_the_model_what_running_its_file_printed(tmp_path):
    from sandbox.agents.code_reviser import revise_message, run_output

    path = tmp_path / "f.py"
    path.write_text("def f(x):\n    return x\nprint(f(3))\nraise ValueError('boom')\n")
    output = run_output(path)
    assert output.startswith("(exit status 1)") and "3" in output and "ValueError: boom" in output
    path.write_text("def f(x):\n    return x\n")
    assert run_output(path) == "(exit status 0, no output)"
    assert "python f.py" in revise_message(path, "x") and "```python" in revise_message(path, "x")
