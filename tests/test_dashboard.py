"""`lockstep dashboard` / `lockstep run --dashboard`: a run's live page. The HTTP side directly, and
the page itself in a real browser (Debian's Chromium through selenium) while a real run trains."""

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from lockstep.monitor.metrics import MetricsLogger
from test_service_backends import unavailable
from helpers import free_port


@pytest.fixture()
def served(tmp_path):
    from lockstep.monitor import dashboard

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"stages": [{"kind": "sft"}, {"kind": "rl"}]}))
    port = free_port()
    server = dashboard.serve(run_dir, port, background=True)
    deadline = time.time() + 20
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    yield run_dir, f"http://127.0.0.1:{port}"
    server.should_exit = True


def test_the_run_state_and_artifacts(served):
    run_dir, url = served
    log = MetricsLogger(run_dir, tensorboard=False)
    log.log(1, {"rollout/reward_mean": 0.5})
    (run_dir / "checkpoints" / "step-1").mkdir(parents=True)
    (run_dir / "ledger.jsonl").write_text(json.dumps({"event": "issued", "ids": ["0.0.0", "0.0.1"]}) + "\n"
                                          + json.dumps({"event": "trained", "ids": ["0.0.0"]}) + "\n")
    s = httpx.get(f"{url}/api/run").json()
    assert [r["rollout/reward_mean"] for r in s["records"]] == [0.5]
    assert s["ledger"] == {"issued": 2, "generated": 0, "rewarded": 0, "trained": 1, "filtered": 0}
    assert s["checkpoints"] == ["step-1"] and set(s["artifacts"]) == {"config.json", "metrics.jsonl", "ledger.jsonl"}
    assert httpx.get(f"{url}/artifacts/config.json").json()["stages"][0]["kind"] == "sft"
    for bad in ("..%2Fconfig.json", "%2Fetc%2Fpasswd", "summary.json", "nothing"):
        assert httpx.get(f"{url}/artifacts/{bad}").status_code == 404, bad
    page = httpx.get(url).text
    assert '<script src="/static/plotly.min.js">' in page
    js = httpx.get(f"{url}/static/plotly.min.js")
    assert js.status_code == 200 and len(js.content) > 1_000_000  # the wheel's own plotly.js


class Refreshes:
    """Counts the server's reads of the run directory (RunView.refresh; the server runs in this
    process), so that a test can wait until the server has read what it wrote."""

    def __init__(self, monkeypatch):
        from lockstep.monitor import dashboard

        self.count, self.cond, original = 0, threading.Condition(), dashboard.RunView.refresh

        def counted(view):
            out = original(view)
            with self.cond:
                self.count += 1
                self.cond.notify_all()
            return out

        monkeypatch.setattr(dashboard.RunView, "refresh", counted)

    def wait_past(self, n: int) -> None:
        """Until a read that began after the count was `n` has ended (the one under way then may
        have begun before)."""
        with self.cond:
            assert self.cond.wait_for(lambda: self.count >= n + 2, timeout=60), "the server stopped reading"


def test_new_records_stream_to_an_open_page(served, monkeypatch):
    """A record written while a page's stream is open is pushed on it (no reload), once whole: the
    server reads the half-written line first and sends nothing of it."""
    run_dir, url = served
    reads = Refreshes(monkeypatch)
    log = MetricsLogger(run_dir, tensorboard=False)
    log.log(1, {"rollout/reward_mean": 0.25})
    after = len(httpx.get(f"{url}/api/run").json()["records"])
    got, opened = [], threading.Event()

    def write_once_open():
        assert opened.wait(60)
        with open(run_dir / "metrics.jsonl", "a") as f:  # half a record first: it must wait for the rest
            line = json.dumps({"step": 2, "time": time.time(), "rollout/reward_mean": 0.75})
            f.write(line[:10])
            f.flush()
            reads.wait_past(reads.count)
            f.write(line[10:] + "\n")

    writer = threading.Thread(target=write_once_open)
    writer.start()
    with httpx.stream("GET", f"{url}/api/events?after={after}", timeout=60) as r:
        event = None
        for line in r.iter_lines():
            opened.set()  # the stream is open (its first line is the retry hint): now the record is written
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: ") and event == "record":
                got.append(json.loads(line[6:]))
                break
    writer.join()
    assert [g["rollout/reward_mean"] for g in got] == [0.75]  # whole, and the earlier record was not sent again


def wait_for(pred, what, timeout=180):
    """pred()'s first true value, polled every 0.2 s. A page that redraws itself (every list and
    panel does, every 2 s) may replace an element between finding it and using it: such a try
    counts as not yet, and the next poll finds the new element."""
    from selenium.common.exceptions import ElementNotInteractableException, StaleElementReferenceException

    end = time.time() + timeout
    while time.time() < end:
        try:
            value = pred()
        except (StaleElementReferenceException, ElementNotInteractableException):
            value = None
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def click(driver, css: str) -> bool:
    """Click the element `css` finds (for wait_for: False while it is missing, being redrawn or not
    yet interactable)."""
    found = driver.find_elements("css selector", css)
    if not found:
        return False
    found[0].click()
    return True


def _browser():
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chromium and driver):
        unavailable("Chromium and its driver are not installed (scripts/setup.sh installs them when run as root)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1800"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    os.environ["SE_OFFLINE"] = "true"  # selenium must not fetch a driver: Debian's is given
    return webdriver.Chrome(service=Service(driver), options=opts)


def _up(port) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/api/run", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.slow  # integration tier (pytest -m slow): kept out of the 20-minute default suite
def test_a_running_runs_page_updates_live_in_a_browser(tmp_path, builtin_dir):
    """`lockstep run --dashboard`: the page's reward curve grows as RL steps arrive and the console
    stays free of errors; then `lockstep dashboard` on the finished run shows every step, and its
    pipeline panel metrics.jsonl's latest numbers."""
    port, run_dir = free_port(), tmp_path / "run"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen([sys.executable, "-m", "lockstep.cli", "run", "--run-dir", str(run_dir), "--dashboard",
                             str(port), f"model.path='{builtin_dir}'", "stages.0.steps=4", "stages.0.batch_size=8",
                             "stages.0.eval_every=100", "stages.0.target_accuracy=0.0", "rl.steps=12",
                             "rl.prompts_per_step=2", "rl.group_size=4", "rl.eval_every=100", "rl.max_seconds=0",
                             "rl.max_staleness=1", "env.num_heldout=8", "env.pass_k=0"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    driver = _browser()
    try:
        deadline = time.time() + 120
        while not _up(port) and time.time() < deadline:
            time.sleep(0.3)
        driver.get(f"http://127.0.0.1:{port}/")

        def points():
            return driver.execute_script(
                "const d = document.getElementById('chart-reward').data; return d && d.length ? d[0].x.length : 0")

        first = wait_for(lambda: points() >= 2 and points(), "two points on the reward curve")
        wait_for(lambda: points() > first, "the reward curve to grow as steps arrive")
        wait_for(lambda: driver.find_element("id", "status").text == "live", "the live stream")
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == [], errors
        assert proc.wait(timeout=300) == 0  # the run's page goes with it; `lockstep dashboard` shows the finished run
        proc = subprocess.Popen([sys.executable, "-m", "lockstep.cli", "dashboard", str(run_dir), "--port", str(port)],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        wait_for(lambda: _up(port), "lockstep dashboard", timeout=60)
        driver.get("about:blank")  # the first page logged its stream's end when the run's server went:
        driver.get_log("browser")  # leave it, and its log, behind
        driver.get(f"http://127.0.0.1:{port}/")
        wait_for(lambda: driver.find_element("id", "status").text == "live", "the page to connect")
        records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        rl = [r for r in records if "rollout/reward_mean" in r]
        wait_for(lambda: points() == len(rl), "every RL step on the curve", timeout=10)
        latest = {}
        for r in records:
            latest.update({k: v for k, v in r.items() if isinstance(v, (int, float))})
        cells = {c.get_attribute("data-key"): c.text for c in driver.find_elements("css selector", "#pipeline td[data-key]")}
        for key in ("throughput/samples_per_s", "queue/in_flight_batches", "time/step_s", "rollout/staleness_max"):
            assert key in latest and float(cells[key]) == pytest.approx(latest[key], rel=1e-3), (key, cells[key])
        for key, shown in cells.items():  # every number shown is metrics.jsonl's latest; the rest say so
            assert (float(shown) == pytest.approx(latest[key], rel=1e-3)) if key in latest else shown == "–", key
        assert driver.find_element("id", "step").text == str(records[-1]["step"])
        ledger = driver.find_element("id", "v-ledger-trained").text
        assert int(ledger) == 12 * 2  # every trained group, from ledger.jsonl
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == [], errors
        shots = Path(os.environ.get("LOCKSTEP_TEST_ARTIFACTS", tmp_path))
        shots.mkdir(parents=True, exist_ok=True)
        driver.save_screenshot(str(shots / "dashboard.png"))
    finally:
        driver.quit()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def test_a_directory_of_runs_lists_them_and_serves_each_page(tmp_path):
    """`lockstep dashboard runs/`: the runs with their step, reward, accuracy and firing alerts, each
    one's page under /runs/NAME/; a name outside the directory is a 404."""
    from lockstep.monitor import dashboard

    for name, reward in (("a", 0.25), ("b", 0.5)):
        d = tmp_path / "runs" / name
        d.mkdir(parents=True)
        (d / "config.json").write_text("{}")
        log = MetricsLogger(d, tensorboard=False)
        log.log(1, {"rollout/reward_mean": reward / 2})
        log.log(2, {"rollout/reward_mean": reward, "eval/accuracy": 0.1})
        log.close()
    (tmp_path / "runs" / "b" / "alerts.jsonl").write_text(json.dumps({"rule": "r", "status": "firing"}) + "\n")
    (tmp_path / "runs" / "not-a-run").mkdir()
    port = free_port()
    server = dashboard.serve(tmp_path / "runs", port, background=True)
    deadline = time.time() + 20
    while not server.started and time.time() < deadline:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    try:
        runs = httpx.get(f"{url}/api/runs").json()["runs"]
        assert [(r["name"], r["step"], r["rollout_reward_mean"], r["alerts_firing"]) for r in runs] == [
            ("a", 2, 0.25, []), ("b", 2, 0.5, ["r"])]
        assert [x["rollout/reward_mean"] for x in httpx.get(f"{url}/runs/b/api/run").json()["records"]] == [0.25, 0.5]
        for bad in ("not-a-run", "..", "%2E%2E", "c"):
            assert httpx.get(f"{url}/runs/{bad}/api/run").status_code == 404, bad
        driver = _browser()
        try:
            driver.get(url + "/")
            while not driver.find_elements("id", "run-a") and time.time() < deadline + 20:
                time.sleep(0.1)
            driver.find_element("css selector", "#run-a a").click()
            end = time.time() + 20
            points = 0
            while points < 2 and time.time() < end:
                points = driver.execute_script(
                    "const d = document.getElementById('chart-reward').data; return d && d.length ? d[0].x.length : 0")
                time.sleep(0.1)
            assert points == 2 and driver.current_url == f"{url}/runs/a/"
            assert [e for e in driver.get_log("browser") if e["level"] == "SEVERE"] == []
        finally:
            driver.quit()
    finally:
        server.should_exit = True
