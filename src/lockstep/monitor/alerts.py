"""Alert rules over a run's step metrics: declared in TOML, evaluated while the run writes
metrics.jsonl, and sent to a webhook.

A rule is pending while its condition holds and fires once it has held for `for_s` seconds (wall
clock); it resolves when the condition stops holding. Each firing and resolving is appended to
RUN_DIR/alerts.jsonl and POSTed as JSON to the webhook, from a queue that a background thread
drains with retries and exponential backoff, so a webhook that is down never blocks training; a
full queue drops the newest event and counts it. The shipped rules are default_alerts.toml.
"""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
import time
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path

from lockstep.config.types import ConfigError
from lockstep.monitor.runfile import MetricsFile

log = logging.getLogger(__name__)

CONDITIONS = (">", ">=", "<", "<=", "below_peak_fraction", "unchanged")
SEVERITIES = ("info", "warning", "critical")
DEFAULT_RULES = Path(__file__).with_name("default_alerts.toml")
SERVICE_RULES = Path(__file__).with_name("service_alerts.toml")


class AlertConfigError(ConfigError):
    pass


@dataclass(frozen=True)
class AlertRule:
    name: str
    metric: str
    condition: str
    threshold: float = 0.0
    for_s: float = 0.0
    severity: str = "warning"
    description: str = ""

    def holds(self, value: float | None, peak: float | None, unchanged_s: float) -> bool:
        """Whether the condition holds for the metric's latest value (None: never seen)."""
        if self.condition == "unchanged":
            return unchanged_s >= self.for_s
        if value is None:
            return False
        if self.condition == "below_peak_fraction":
            return peak is not None and peak > 0 and value < self.threshold * peak
        return {">": value > self.threshold, ">=": value >= self.threshold, "<": value < self.threshold,
                "<=": value <= self.threshold}[self.condition]


def parse_rules(text: str, source: str = "alert rules") -> list[AlertRule]:
    """Rules from TOML ([[rule]] tables); a malformed one is an AlertConfigError naming the rule
    and the field."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise AlertConfigError(f"{source}: invalid TOML: {e}") from None
    extra = set(doc) - {"rule"}
    if extra:
        raise AlertConfigError(f"{source}: unknown top-level key(s) {sorted(extra)}; rules go in [[rule]] tables")
    tables = doc.get("rule", [])
    if not isinstance(tables, list) or not tables:
        raise AlertConfigError(f"{source}: no [[rule]] tables")
    rules, names = [], set()
    for i, t in enumerate(tables):
        rule = _rule(t, f"{source}: rule {i} ({t.get('name', 'unnamed')!r})")
        if rule.name in names:
            raise AlertConfigError(f"{source}: two rules are named {rule.name!r}")
        names.add(rule.name)
        rules.append(rule)
    return rules


def _rule(t: dict, where: str) -> AlertRule:
    known = {f.name for f in fields(AlertRule)}
    for key in t:
        if key not in known:
            raise AlertConfigError(f"{where}: unknown field {key!r}; expected some of {sorted(known)}")
    for key in ("name", "metric", "condition"):
        if not isinstance(t.get(key), str) or not t[key].strip():
            raise AlertConfigError(f"{where}: field {key!r} is required (a non-empty string)")
    if t["condition"] not in CONDITIONS:
        raise AlertConfigError(f"{where}: field 'condition' must be one of {list(CONDITIONS)}, got {t['condition']!r}")
    for key in ("threshold", "for_s"):
        value = t.get(key, 0.0)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise AlertConfigError(f"{where}: field {key!r} must be a finite number, got {value!r}")
    if t.get("for_s", 0.0) < 0:
        raise AlertConfigError(f"{where}: field 'for_s' must be >= 0 seconds, got {t['for_s']!r}")
    if t["condition"] == "unchanged" and t.get("for_s", 0.0) <= 0:
        raise AlertConfigError(f"{where}: field 'for_s' must be > 0 for the 'unchanged' condition")
    if t.get("severity", "warning") not in SEVERITIES:
        raise AlertConfigError(f"{where}: field 'severity' must be one of {list(SEVERITIES)}, got {t['severity']!r}")
    if not isinstance(t.get("description", ""), str):
        raise AlertConfigError(f"{where}: field 'description' must be a string")
    return AlertRule(**{**t, "threshold": float(t.get("threshold", 0.0)), "for_s": float(t.get("for_s", 0.0))})


def load_rules(path: str | Path | None = None, default: Path = DEFAULT_RULES) -> list[AlertRule]:
    """The rules in `path`, or the shipped defaults (a run's, or SERVICE_RULES)."""
    path = Path(path) if path else default
    try:
        text = path.read_text()
    except OSError as e:
        raise AlertConfigError(f"alert rules {str(path)!r}: cannot read it ({e.strerror or e})") from None
    return parse_rules(text, str(path))


class Webhook:
    """POSTs events as JSON from a bounded queue, in a daemon thread, retrying failures (network
    errors, 429 and 5xx answers) with exponential backoff. Events past `max_queue` waiting are
    dropped and counted; so are events that exhaust their retries."""

    def __init__(self, url: str, *, max_queue: int = 1000, retries: int = 5, backoff_s: float = 0.5,
                 timeout_s: float = 5.0):
        import httpx

        if not url.startswith(("http://", "https://")):
            raise AlertConfigError(f"alert webhook {url!r}: expected an http:// or https:// URL")
        self.url, self.retries, self.backoff_s = url, retries, backoff_s
        self._client = httpx.Client(timeout=timeout_s)
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self.sent = self.dropped = self.failed = 0
        threading.Thread(target=self._drain, name="alert-webhook", daemon=True).start()

    def send(self, event: dict) -> None:
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self.dropped += 1
            log.warning("alert queue full (%d waiting): dropped %s %s", self._queue.maxsize, event["status"], event["rule"])

    def join(self, timeout: float = 30.0) -> bool:
        """Wait until every queued event was delivered or given up (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.02)
        return not self._queue.unfinished_tasks

    def _drain(self) -> None:
        while True:
            event = self._queue.get()
            try:
                self._deliver(event)
            finally:
                self._queue.task_done()

    def _deliver(self, event: dict) -> None:
        why = "refused"
        for attempt in range(self.retries + 1):
            try:
                r = self._client.post(self.url, json=event)
                if r.status_code < 300:
                    self.sent += 1
                    return
                if r.status_code != 429 and r.status_code < 500:
                    break  # the receiver refuses it: retrying will not help
                why = f"HTTP {r.status_code}"
            except Exception as e:  # noqa: BLE001 - any network failure is retried
                why = str(e) or type(e).__name__
            if attempt < self.retries:
                time.sleep(self.backoff_s * 2**attempt)
        self.failed += 1
        log.warning("alert webhook %s: gave up on %s %s (%s)", self.url, event["status"], event["rule"], why)


@dataclass
class _State:
    pending_since: float | None = None
    firing: bool = False
    peak: float | None = None
    last_value: float | None = None
    changed_at: float = field(default_factory=time.time)


class AlertEngine:
    """Evaluates rules against a run's metrics.jsonl (or records handed to `check`: the service's
    numbers); `check()` once per evaluation interval. Events go to `run_dir`/alerts.jsonl."""

    def __init__(self, run_dir: Path, rules: list[AlertRule], webhook: Webhook | None = None, *, clock=time.time):
        self.run_dir, self.rules, self.webhook, self.clock = Path(run_dir), rules, webhook, clock
        self.file = MetricsFile(self.run_dir / "metrics.jsonl")
        now = clock()
        self.states = {r.name: _State(changed_at=now) for r in rules}
        self.firing: set[str] = set()

    def check(self, records: list[dict] | None = None) -> list[dict]:
        """Take new records (read from metrics.jsonl unless given), update every rule; return the
        events (firing, resolved) raised now."""
        now = self.clock()
        records = self.file.refresh() if records is None else records
        events = []
        for rule in self.rules:
            st = self.states[rule.name]
            for r in records:  # peaks and changes are tracked over every record, not only the latest
                value = self._value(rule, r)
                if value is not None:
                    st.peak = value if st.peak is None else max(st.peak, value)
                    if value != st.last_value:
                        st.last_value, st.changed_at = value, now
            value = st.last_value
            if rule.holds(value, st.peak, now - st.changed_at):
                st.pending_since = now if st.pending_since is None else st.pending_since
                if not st.firing and (rule.condition == "unchanged" or now - st.pending_since >= rule.for_s):
                    st.firing = True
                    events.append(self._event(rule, "firing", value, now))
            else:
                st.pending_since = None
                if st.firing:
                    st.firing = False
                    events.append(self._event(rule, "resolved", value, now))
        for e in events:
            self._emit(e)
        return events

    @staticmethod
    def _value(rule: AlertRule, record: dict) -> float | None:
        v = record.get(rule.metric)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v):
            return float(v)
        return None

    def _event(self, rule: AlertRule, status: str, value, now: float) -> dict:
        (self.firing.add if status == "firing" else self.firing.discard)(rule.name)
        return {"status": status, "rule": rule.name, "severity": rule.severity, "metric": rule.metric,
                "condition": rule.condition, "threshold": rule.threshold, "for_s": rule.for_s, "value": value,
                "step": self.file.step, "description": rule.description, "run_dir": str(self.run_dir), "time": now}

    def _emit(self, event: dict) -> None:
        with open(self.run_dir / "alerts.jsonl", "a") as f:
            f.write(json.dumps(event) + "\n")
        log.warning("alert %s: %s (%s %s %s, value %s)", event["status"], event["rule"], event["metric"],
                    event["condition"], event["threshold"], event["value"])
        if self.webhook is not None:
            self.webhook.send(event)


def watch(run_dir: Path, rules: list[AlertRule], webhook: Webhook | None, every_s: float = 2.0,
          source=None) -> AlertEngine:
    """Evaluate `rules` every `every_s` seconds from a daemon thread, for as long as the process
    runs: over the run's metrics.jsonl, or over `source()`'s record each time (the service)."""
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    engine = AlertEngine(run_dir, rules, webhook)

    def loop():
        while True:
            try:
                engine.check(None if source is None else [source()])
            except Exception:  # noqa: BLE001 - alerting never stops the run or the service
                log.warning("alert evaluation failed", exc_info=True)
            time.sleep(every_s)

    threading.Thread(target=loop, name="alerts", daemon=True).start()
    return engine
