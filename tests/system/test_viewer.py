"""The trace viewer at /ui, driven by headless Chromium (Debian's `chromium` and
`chromium-driver`, through Selenium) against a gateway holding rollouts recorded from the real
tiny vLLM: login, filters, a rollout page whose token colours match /traces, a recorded
`<script>` shown as text, a rollout key refused everywhere under /ui, and the run page drawing
a live run (a real runner and bridge, their /metrics read through the gateway's --run-metrics)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import openai
import pytest

from stack.experiment.tasks import generate, length_variant, write_tasks
from stack.rollouts import finished, rollouts_command
from stack.serve_model import start_vllm
from tests.support.gateway import ADMIN_KEY, REPO, GatewayProcess, free_port
from tests.support.postgres import fresh_database
from tests.support.vllm import PICK_COLOR_TOOL, TINY_MODEL_NAME, load_tiny_tokenizer
from trainer_bridge.checkpoints import untie_embeddings
from trainer_bridge.config import match_arg

HOSTILE = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'


@pytest.fixture(scope="module")
def viewer_dsn():
    dsn, drop = fresh_database("rolltap_viewer")
    yield dsn
    drop()


class LiveRunPorts:
    """Where the live run's runner (`rolltap rollouts --metrics-port`) and bridge (`rolltap
    bridge --metrics-port`) serve their /metrics: the gateway is told at its start (its
    --run-metrics), before they run."""

    def __init__(self) -> None:
        self.runner, self.bridge = free_port(), free_port()

    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}/metrics" for port in (self.runner, self.bridge)]


@pytest.fixture(scope="module")
def live_ports():
    return LiveRunPorts()


@pytest.fixture(scope="module")
def viewer_gateway(vllm_server, viewer_dsn, live_ports, tmp_path_factory):
    dsn = viewer_dsn
    # The conversations offer a strict tool, which makes their calls constrained: trained (and
    # stamped with the policy version) only under --train-constrained.
    runs = [arg for url in live_ports.urls() for arg in ("--run-metrics", url)]
    gw = GatewayProcess([vllm_server.url], dsn, "--tokenizer", str(vllm_server.model_dir),
                        "--train-constrained", *runs,
                        log_path=tmp_path_factory.mktemp("viewer") / "gateway.log").start()
    yield gw
    gw.stop()


def _chat(rollout: dict, model: str, messages: list[dict]) -> dict:
    client = openai.OpenAI(base_url=rollout["openai_base_url"], api_key=rollout["api_key"])
    # Tools offered: a toolless call would form an auxiliary sequence, not trained.
    reply = client.chat.completions.create(model=model, messages=messages, max_tokens=12,
                                           temperature=1.0, tools=[PICK_COLOR_TOOL])
    return reply.choices[0].message.model_dump(exclude_none=True)


@pytest.fixture(scope="module")
def recorded(viewer_gateway, vllm_server):
    """Three finished rollouts: a two-call conversation sampled under two policy versions, one
    whose user message is hostile HTML, and a failed one."""
    gw, model = viewer_gateway, vllm_server.model
    two = gw.new_rollout(task_id="beta", group_id="g2")
    first = [{"role": "user", "content": "Say something."}]
    reply = _chat(two, model, first)
    assert gw.admin.post("/admin/policy", json={"version": 3}).status_code == 200
    _chat(two, model, [*first, reply, {"role": "user", "content": "And again."}])
    assert gw.finish(two["rollout_id"], 0.25, metrics={"tests_passed": 1}).status_code == 200

    hostile = gw.new_rollout(task_id="alpha", group_id="g1")
    _chat(hostile, model, [{"role": "user", "content": HOSTILE}])
    assert gw.finish(hostile["rollout_id"], 1.0,
                     metrics={"reward_detail": HOSTILE}).status_code == 200

    failed = gw.new_rollout(task_id="alpha", group_id="g1")
    assert gw.finish(failed["rollout_id"], None, status="failed",
                     metrics={"stderr_tail": "\x1b]0;pwned\x07\x1b[2J"}).status_code == 200
    return {"two": two["rollout_id"], "hostile": hostile["rollout_id"],
            "failed": failed["rollout_id"]}


@pytest.fixture(scope="module")
def browser():
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        pytest.fail("Debian's chromium and chromium-driver are needed: "
                    "apt-get install -y chromium chromium-driver (the Makefile's `install` does)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1000", "--disable-extensions", "--no-first-run"):
        options.add_argument(arg)
    drv = webdriver.Chrome(service=Service(driver), options=options)
    yield drv
    drv.quit()


def _wait(drv, script: str, timeout: float = 30):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(drv, timeout).until(lambda d: d.execute_script(script))


def _tokens(drv, k: int) -> list[dict]:
    return drv.execute_script(
        "return [...document.querySelectorAll(`.tokens[data-sequence='${arguments[0]}'] .tok`)]"
        ".map(t => ({i: +t.dataset.i, id: +t.dataset.id, mask: +t.dataset.mask,"
        " version: +t.dataset.version, colour: getComputedStyle(t).backgroundColor,"
        " text: t.textContent}))", k)


def _legend(drv, attr: str) -> dict[int, str]:
    return {int(k): v for k, v in drv.execute_script(
        f"return [...document.querySelectorAll('#legend [data-{attr}]')]"
        f".map(s => [s.dataset.{attr}, getComputedStyle(s).backgroundColor])")}


def _login(drv, url: str, key: str) -> None:
    from selenium.webdriver.common.by import By

    drv.get(url + "/ui")
    drv.delete_all_cookies()
    drv.get(url + "/ui")
    drv.find_element(By.ID, "key").send_keys(key)
    drv.find_element(By.ID, "login-submit").click()


def test_login_filter_open_and_token_colours_match_traces(
    browser, viewer_gateway, recorded, vllm_server, tmp_path
):
    from selenium.webdriver.common.by import By

    gw = viewer_gateway
    _login(browser, gw.url, "not-the-key")
    # The refused login answers with the form again (a new page: wait for it, not the old one).
    _wait(browser, "const e = document.getElementById('login-error');"
                   " return e && e.textContent.includes('not the admin key')")
    _login(browser, gw.url, ADMIN_KEY)
    _wait(browser, "return document.body.dataset.ready")
    assert len(browser.find_elements(By.CSS_SELECTOR, "#rollout-rows tr[data-rollout]")) == 3
    cookie = browser.get_cookie("rolltap_ui")
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"

    browser.find_element(By.ID, "f-task").send_keys("beta")
    browser.find_element(By.ID, "apply-filters").click()
    _wait(browser, "return document.body.dataset.ready.includes('task=beta')"
                   " && document.querySelectorAll('#rollout-rows tr[data-rollout]').length === 1")
    browser.find_element(By.CSS_SELECTOR, f"tr[data-rollout='{recorded['two']}'] a").click()
    _wait(browser, "return document.querySelector('.tokens .tok')")

    traces = gw.admin.get(f"/admin/rollouts/{recorded['two']}/traces").json()["sequences"]
    assert traces
    colours = _legend(browser, "mask")
    assert set(colours) == {0, 1} and colours[0] != colours[1]
    for k, seq in enumerate(traces):
        tokens = _tokens(browser, k)
        assert [t["id"] for t in tokens] == seq["input_ids"]
        assert [t["mask"] for t in tokens] == seq["loss_mask"]
        assert [t["colour"] for t in tokens] == [colours[m] for m in seq["loss_mask"]]
    # Decoded on the server with the model's tokenizer, token by token (a token holding part
    # of a UTF-8 character shows its bytes escaped).
    tokenizer = load_tiny_tokenizer(vllm_server.model_dir)
    whole = [t for t in _tokens(browser, 0) if "\ufffd" not in tokenizer.decode([t["id"]])]
    assert len(whole) > 0.9 * len(traces[0]["input_ids"])
    assert [t["text"] for t in whole] == [tokenizer.decode([t["id"]]) for t in whole]

    browser.find_element(By.ID, "mode-version").click()
    versions = {v for seq in traces for v in seq["versions"]}
    assert {0, 3} <= versions  # the second call was sampled after the policy moved to 3
    colours = _legend(browser, "version")
    assert set(colours) == versions and len(set(colours.values())) == len(versions)
    for k, seq in enumerate(traces):
        assert [t["colour"] for t in _tokens(browser, k)] == [colours[v] for v in seq["versions"]]
    boundaries = browser.find_elements(By.CSS_SELECTOR, ".boundary:not(.end)")
    assert len(boundaries) >= 2  # both calls' sampled spans are marked
    assert browser.find_element(By.CSS_SELECTOR, ".badge.cause").get_attribute("data-cause")
    timeline = browser.find_elements(By.CSS_SELECTOR, "#timeline tbody tr")
    assert len(timeline) == 2
    browser.save_screenshot(str(tmp_path / "rollout.png"))
    assert (tmp_path / "rollout.png").stat().st_size > 10_000


def test_recorded_script_is_shown_as_text(browser, viewer_gateway, recorded):
    from selenium.webdriver.common.by import By

    _login(browser, viewer_gateway.url, ADMIN_KEY)
    # The login's answer (a redirect to /ui) must be in before the next navigation: a `get` that
    # overtakes it lands on the login page, and the list replaces it when the answer comes.
    _wait(browser, "return document.body.dataset.ready")
    browser.get(f"{viewer_gateway.url}/ui#/rollout/{recorded['hostile']}")
    _wait(browser, "return document.querySelector('#conversation .msg')")
    assert browser.execute_script("return window.__pwned") is None
    assert HOSTILE in browser.find_element(By.ID, "conversation").text
    assert HOSTILE in browser.find_element(By.ID, "verifier").text
    assert not browser.find_elements(By.CSS_SELECTOR, "#app script, #app img")


def test_rollout_key_never_opens_the_viewer(viewer_gateway, recorded):
    gw = viewer_gateway
    live = gw.new_rollout(task_id="key-probe")
    paths = ["/ui", "/ui/api/rollouts", f"/ui/api/rollouts/{recorded['two']}"]
    for path in paths:
        as_rollout = httpx.get(gw.url + path,
                               headers={"Authorization": f"Bearer {live['api_key']}"})
        assert as_rollout.status_code == 403, (path, as_rollout.text)
        as_cookie = httpx.get(gw.url + path, cookies={"rolltap_ui": live["api_key"]})
        assert as_cookie.status_code == 403, path
        forged = httpx.get(gw.url + path, cookies={"rolltap_ui": "9999999999.00"})
        assert forged.status_code == 401, path
        assert httpx.get(gw.url + path).status_code == 401, path
    login = httpx.post(gw.url + "/ui/login", data={"key": live["api_key"]})
    assert login.status_code == 401 and "rolltap_ui" not in login.cookies
    # The admin key as a header opens the data routes.
    assert gw.admin.get("/ui/api/rollouts").status_code == 200


def test_list_pages_without_repeats_and_filters_by_reward(viewer_gateway, recorded):
    gw = viewer_gateway
    made = [gw.new_rollout(task_id="paged", group_id="p")["rollout_id"] for _ in range(7)]
    seen, after = [], None
    while True:
        r = gw.admin.get("/ui/api/rollouts", params={"task": "paged", "limit": 3,
                                                     **({"after": after} if after else {})})
        assert r.status_code == 200, r.text
        body = r.json()
        seen += [x["rollout_id"] for x in body["rollouts"]]
        after = body["next"]
        if after is None:
            break
    assert seen == made[::-1]
    hits = gw.admin.get("/ui/api/rollouts", params={"min_reward": 0.5}).json()["rollouts"]
    assert [x["rollout_id"] for x in hits] == [recorded["hostile"]]
    for bad in ({"status": "odd"}, {"min_reward": "x"}, {"after": "!!"}, {"limit": 0}):
        r = gw.admin.get("/ui/api/rollouts", params=bad)
        assert r.status_code == 400 and r.json()["error"]["message"], bad


class LiveRun:
    """A run going on while the page is open, as a user runs one, beside the viewer's gateway:
    its own tiny vLLM (untied, which the bridge's disk sync needs on the CPU) behind its own
    gateway on the viewer's database; `rolltap rollouts` plays two tasks in groups of 4 (the
    code-writer agent in sandboxes) and `rolltap bridge` trains on them and pushes the weights
    back, each serving its /metrics where the viewer's gateway reads them. The reward is the
    learning experiment's positive control (the reply's length near a target), which the tiny
    model's replies spread over, so groups train."""

    def __init__(self, dsn: str, tiny_model_dir: Path, ports: LiveRunPorts,
                 workdir: Path) -> None:
        self.dsn, self.ports, self.workdir = dsn, ports, workdir
        self.model = untie_embeddings(tiny_model_dir, workdir / "untied")
        self.run_id = f"live-{uuid.uuid4().hex[:8]}"
        tasks = [length_variant(t, 300) for t in generate(0, "live", ["divisible"], 2)]
        self.task_ids = [t["id"] for t in tasks]
        self.tasks_file = write_tasks(workdir / "tasks.jsonl", tasks)
        self.state = workdir / "state.jsonl"
        self.env = {**os.environ, "ROLLTAP_ADMIN_KEY": ADMIN_KEY}
        self.logs: dict[str, Path] = {}
        self.procs: dict[str, subprocess.Popen] = {}

    def _commands(self, vllm_url: str, gateway_url: str) -> dict[str, list[str]]:
        return {
            "bridge": [sys.executable, "-m", "trainer_bridge.cli", "bridge",
                       "--model", str(self.model), "--gateway", gateway_url, "--vllm", vllm_url,
                       "--admin-key", ADMIN_KEY, "--database-url", self.dsn,
                       "--num-generations", "4", "--max-steps", "1000", "--token-budget", "4096",
                       "--weight-sync", "disk", "--threads", "1",
                       "--match", match_arg("run_id", self.run_id),
                       "--output-dir", str(self.workdir / "bridge"),
                       "--metrics-port", str(self.ports.bridge)],
            "runner": [*rollouts_command(
                self.tasks_file,
                ["--harness", "python", "--agent", "sandbox.agents.code_writer:run"],
                gateway=gateway_url, model=TINY_MODEL_NAME, run_id=self.run_id,
                state=self.state, group_size=4, concurrency=2, repeat=100),
                "--metrics-port", str(self.ports.runner)],
        }

    def __enter__(self) -> LiveRun:
        self.vllm = start_vllm(self.model, free_port(), served_model_name=TINY_MODEL_NAME,
                               max_model_len=4096, kv_cache_gib=1,
                               log_path=self.workdir / "vllm.log")
        self.gateway = None
        try:
            self.vllm.wait_ready(300)
            self.gateway = GatewayProcess([self.vllm.url], self.dsn,
                                          log_path=self.workdir / "gateway.log").start()
            for name, command in self._commands(self.vllm.url, self.gateway.url).items():
                self.logs[name] = self.workdir / f"{name}.log"
                with self.logs[name].open("w") as log:
                    self.procs[name] = subprocess.Popen(command, cwd=REPO, env=self.env,
                                                        stdout=log, stderr=subprocess.STDOUT)
        except BaseException:
            self.__exit__()
            raise
        return self

    def check(self) -> None:
        """Both still running (a JavaScript wait would otherwise hide a crash until timeout)."""
        for name, proc in self.procs.items():
            assert proc.poll() is None, f"{name} ended:\n{self.logs[name].read_text()[-3000:]}"

    def rollout_ids(self) -> list[str]:
        """The rollouts the runner has finished so far (its state file)."""
        return [r.rollout_id for r in finished(self.state)]

    def __exit__(self, *exc) -> None:
        # The bridge stops at the end of a step (its push done), the runner ends its sandboxes.
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        stuck = []
        for name, proc in self.procs.items():
            try:
                proc.wait(240)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                stuck.append(name)
        if self.gateway is not None:
            self.gateway.stop()
        self.vllm.stop()
        if stuck:
            pytest.fail(f"{stuck} did not stop on SIGTERM; see {self.workdir}")


def _wait_running(drv, run: LiveRun, script: str, timeout: float):
    """`_wait` for `script`, failing at once with its log if the runner or the bridge ends."""
    from selenium.webdriver.support.ui import WebDriverWait

    def ready(d):
        run.check()
        return d.execute_script(script)

    return WebDriverWait(drv, timeout, poll_frequency=1).until(ready)


def _points(drv, chart: str) -> int:
    return drv.execute_script(
        "const c = document.getElementById(arguments[0]); return c ? +c.dataset.points : -1", chart)


@pytest.mark.slow  # its own engine, gateway, runner and bridge: minutes (make test-slow)
def test_run_page_draws_a_live_run(browser, viewer_gateway, viewer_dsn, live_ports,
                                   tiny_model_dir, tmp_path):
    from selenium.webdriver.common.by import By

    gw = viewer_gateway
    _login(browser, gw.url, ADMIN_KEY)
    _wait(browser, "return document.body.dataset.ready")
    with LiveRun(viewer_dsn, tiny_model_dir, live_ports, tmp_path) as run:
        # The run shows up in the page's run picker once it has a rollout.
        browser.find_element(By.ID, "run-link").click()
        _wait(browser, "return document.getElementById('run-select')")
        _wait_running(browser, run, f"return [...document.querySelectorAll('#run-select option')]"
                                    f".some(o => o.value === '{run.run_id}')", timeout=300)
        browser.execute_script(f"location.hash = '#/run?run={run.run_id}'")
        charts = ("chart-reward", "chart-tokens", "chart-staleness", "chart-policy",
                  "chart-pool-queued", "chart-pool-wait", "chart-idle")
        _wait_running(browser, run, "return " + " && ".join(
            f"+(document.getElementById('{c}') || {{dataset: {{}}}}).dataset.points > 0"
            for c in charts), timeout=420)
        before = {c: _points(browser, c) for c in charts}
        # New points arrive by polling, with no reload: the page's own state survives.
        browser.execute_script("window.__same_page = 1")
        _wait_running(browser, run, "return " + " && ".join(
            f"+document.getElementById('{c}').dataset.points > {before[c]}" for c in charts),
                      timeout=600)
        assert browser.execute_script("return window.__same_page") == 1
        # The idle curve is the bridge's own series, a fraction.
        metrics = gw.admin.get("/ui/api/run", params={"run": run.run_id}).json()["metrics"]
        idle = metrics["rolltap_trainer_idle_fraction"]
        assert idle and all(0 <= v <= 1 for _, v in idle), idle
        rollouts = run.rollout_ids()
    tasks = browser.find_element(By.ID, "task-rewards").text
    assert all(task in tasks for task in run.task_ids), tasks
    assert "trained" in browser.find_element(By.ID, "token-totals").text
    browser.save_screenshot(str(tmp_path / "run.png"))
    assert (tmp_path / "run.png").stat().st_size > 10_000

    # The rollout page shows the merge's dicts as tables, not JSON text.
    browser.get(f"{gw.url}/ui#/rollout/{rollouts[0]}")
    _wait(browser, "return document.querySelector('#merge-stats table.dict')")
    causes = browser.find_elements(
        By.CSS_SELECTOR, "#merge-stats dd[data-key='excluded_by_cause'] table.dict tr[data-key]")
    assert causes and "{" not in browser.find_element(By.ID, "merge-stats").text


def _inspect(gw, *args: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "core.cli", "inspect", "--gateway", gw.url, *args],
        cwd=REPO, capture_output=True, text=True, timeout=60,
        env={**os.environ, "ROLLTAP_ADMIN_KEY": ADMIN_KEY})
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_inspect_prints_the_same_information(viewer_gateway, recorded):
    gw = viewer_gateway
    listed = _inspect(gw, "list", "--task", "alpha").splitlines()
    assert sorted(line.split()[0] for line in listed[1:]) == sorted(
        [recorded["hostile"], recorded["failed"]])
    shown = _inspect(gw, "show", recorded["two"], "--tokens", "--colour", "never")
    detail = gw.admin.get(f"/ui/api/rollouts/{recorded['two']}").json()
    for call in detail["calls"]:
        assert f"{call['latency_ms']:.0f}ms" in shown
    for k, seq in enumerate(detail["sequences"]):
        assert f"{k}: {len(seq['input_ids'])} tokens, {sum(seq['loss_mask'])} trained" in shown
    assert "tests_passed: 1" in shown and "⟦" in shown
    # A terminal escape recorded by an agent is printed escaped, never raw.
    hostile = _inspect(gw, "show", recorded["failed"])
    assert "\x1b" not in hostile and "\\x1b]0;pwned" in hostile
    # A rollout that trains nothing says why in one line; one that trains says nothing of it.
    assert "trained nothing: no call of this rollout sampled a token" in hostile.splitlines()
    assert "trained nothing" not in shown
    denied = subprocess.run(
        [sys.executable, "-m", "core.cli", "inspect", "--gateway", gw.url,
         "--admin-key", "rt-not-admin", "list"], capture_output=True, text=True, timeout=60)
    assert denied.returncode != 0 and "403" in denied.stderr
