"""The trace viewer at /ui, driven by headless Chromium (Debian's `chromium` and
`chromium-driver`, through Selenium) against a gateway holding rollouts recorded from the real
tiny vLLM: login, filters, a rollout page whose token colours match /traces, a recorded
`<script>` shown as text, and a rollout key refused everywhere under /ui."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import threading
import uuid

import asyncpg
import httpx
import openai
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from core.store.db import init_connection
from tests.support.gateway import ADMIN_KEY, REPO, GatewayProcess, free_port
from tests.support.postgres import fresh_database
from tests.support.vllm import PICK_COLOR_TOOL, load_tiny_tokenizer
from trainer_bridge import deliveries

HOSTILE = '<script>window.__pwned = 1</script><img src=x onerror="window.__pwned = 2">'


@pytest.fixture(scope="module")
def viewer_dsn():
    dsn, drop = fresh_database("rolltap_viewer")
    yield dsn
    drop()


class StandInRunnerMetrics:
    """STAND-IN for `rolltap rollouts --metrics-port` (the runner's own /metrics): its pool
    series under the runner's names, served by prometheus_client, moved by the test's run."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.waiting = Gauge("rolltap_runner_pool_waiting", "phases queued for a slot", ["pool"],
                             registry=self.registry)
        self.waited = Counter("rolltap_runner_pool_queue_wait_seconds",
                              "time phases queued for a slot", ["pool"], registry=self.registry)
        self.port = free_port()
        self.server, self.thread = start_http_server(self.port, "127.0.0.1", self.registry)
        self.url = f"http://127.0.0.1:{self.port}/metrics"

    def group_done(self, k: int) -> None:
        self.waiting.labels("verify").set(k % 3)
        self.waited.labels("verify").inc(0.5 * (k % 4))


@pytest.fixture(scope="module")
def runner_metrics():
    m = StandInRunnerMetrics()
    yield m
    m.server.shutdown()
    m.server.server_close()


@pytest.fixture(scope="module")
def viewer_gateway(vllm_server, viewer_dsn, runner_metrics, tmp_path_factory):
    dsn = viewer_dsn
    # The conversations offer a strict tool, which makes their calls constrained: trained (and
    # stamped with the policy version) only under --train-constrained.
    gw = GatewayProcess([vllm_server.url], dsn, "--tokenizer", str(vllm_server.model_dir),
                        "--train-constrained", "--run-metrics", runner_metrics.url,
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


async def _book_as_trained(dsn: str, run_id: str, group_id: str, step: int) -> None:
    """STAND-IN for a trainer (no model trains): one group goes through the bridge's own
    delivery log (trainer_bridge/deliveries.py) as if optimizer step `step` trained it, which
    gives its rollouts a ledger and a consumption time, as a bridge would."""
    conn = await asyncpg.connect(dsn)
    try:
        await init_connection(conn)
        owner = f"stand-in-trainer-{run_id}"
        rows = await deliveries.claim_group(conn, owner, group_id, {"run_id": run_id}, 60)
        assert rows, f"group {group_id} was not deliverable"
        ids = [r.id for r in rows]
        await deliveries.release_group(conn, owner, dict.fromkeys(ids, 1.0), [], [])
        traces = await deliveries.undelivered_traces(conn, ids)
        await deliveries.acknowledge(conn, owner, step, [
            deliveries.Entry(rid, idx, "trained", int(t.loss_mask.sum()), 0)
            for rid, found in traces.items() for idx, t in found])
    finally:
        await conn.close()


class LiveRun:
    """A run going on while the page is open: groups of two rollouts on two tasks, one call to
    the tiny vLLM each, rewards that differ, the policy version moved after each group, and each
    group taken by a stand-in trainer once the next one has ended."""

    def __init__(self, gw, dsn: str, model: str, metrics: StandInRunnerMetrics) -> None:
        self.gw, self.dsn, self.model, self.metrics = gw, dsn, model, metrics
        self.run_id = f"live-{uuid.uuid4().hex[:8]}"
        self.rollouts: list[str] = []
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._produce, daemon=True)

    def _produce(self) -> None:
        try:
            for k in range(10_000):
                if self.stop.is_set():
                    return
                for member in range(2):
                    r = self.gw.new_rollout(task_id=f"live-task-{k % 2}",
                                            group_id=f"{self.run_id}-{k}",
                                            metadata={"run_id": self.run_id})
                    _chat(r, self.model, [{"role": "user", "content": f"Count to {k + member}."}])
                    assert self.gw.finish(r["rollout_id"], (k + member) % 3 / 2).status_code == 200
                    self.rollouts.append(r["rollout_id"])
                version = self.gw.admin.get("/admin/policy").json()["version"]
                assert self.gw.admin.post("/admin/policy",
                                          json={"version": version + 1}).status_code == 200
                self.metrics.group_done(k)
                if k:
                    asyncio.run(_book_as_trained(self.dsn, self.run_id, f"{self.run_id}-{k - 1}",
                                                 k))
        except BaseException as exc:  # noqa: BLE001 - the test reports it
            self.error = exc

    def __enter__(self) -> LiveRun:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(300)


def _points(drv, chart: str) -> int:
    return drv.execute_script(
        "const c = document.getElementById(arguments[0]); return c ? +c.dataset.points : -1", chart)


def test_run_page_draws_a_live_run(browser, viewer_gateway, viewer_dsn, runner_metrics,
                                   vllm_server, tmp_path):
    from selenium.webdriver.common.by import By

    gw = viewer_gateway
    _login(browser, gw.url, ADMIN_KEY)
    _wait(browser, "return document.body.dataset.ready")
    with LiveRun(gw, viewer_dsn, vllm_server.model, runner_metrics) as run:
        # The run shows up in the page's run picker once it has a rollout.
        browser.find_element(By.ID, "run-link").click()
        _wait(browser, "return document.getElementById('run-select')")
        _wait(browser, f"return [...document.querySelectorAll('#run-select option')]"
                       f".some(o => o.value === '{run.run_id}')", timeout=300)
        browser.execute_script(f"location.hash = '#/run?run={run.run_id}'")
        charts = ("chart-reward", "chart-tokens", "chart-staleness", "chart-policy",
                  "chart-pool-queued", "chart-pool-wait")
        _wait(browser, "return " + " && ".join(
            f"+(document.getElementById('{c}') || {{dataset: {{}}}}).dataset.points > 0"
            for c in charts), timeout=300)
        before = {c: _points(browser, c) for c in charts}
        # New points arrive by polling, with no reload: the page's own state survives.
        browser.execute_script("window.__same_page = 1")
        _wait(browser, "return " + " && ".join(
            f"+document.getElementById('{c}').dataset.points > {before[c]}" for c in charts),
              timeout=600)
        assert browser.execute_script("return window.__same_page") == 1
        assert run.error is None, run.error
    assert run.error is None, run.error
    tasks = browser.find_element(By.ID, "task-rewards").text
    assert "live-task-0" in tasks and "live-task-1" in tasks
    totals = browser.find_element(By.ID, "token-totals").text
    assert "trained" in totals and "awaiting trainer" in totals  # taken, and not yet taken
    browser.save_screenshot(str(tmp_path / "run.png"))
    assert (tmp_path / "run.png").stat().st_size > 10_000

    # The rollout page shows the merge's dicts as tables, not JSON text.
    browser.get(f"{gw.url}/ui#/rollout/{run.rollouts[0]}")
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
