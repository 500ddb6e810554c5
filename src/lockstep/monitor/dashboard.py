"""`lockstep dashboard RUN_DIR`: a run's live page.

The server reads the run directory as the run writes it (metrics.jsonl through runfile.MetricsFile,
alerts.jsonl, ledger.jsonl, checkpoints/) and pushes new records to the page over server-sent
events, polling the files twice a second, so a page shows a step within a second of it being
written. The charts are plotly.js, served from the plotly wheel's own copy. Only the run
directory's known artifacts can be fetched (no path from the URL reaches the file system).
"""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

from lockstep.monitor.runfile import LEDGER_EVENTS, JsonLines, MetricsFile, ledger_counts

PAGE = Path(__file__).with_name("dashboard.html")
RUNS_PAGE = Path(__file__).with_name("runs.html")
ARTIFACTS = {"report.html": "text/html", "summary.json": "application/json", "metrics.jsonl": "application/x-ndjson",
             "config.json": "application/json", "alerts.jsonl": "application/x-ndjson",
             "trace.jsonl": "application/x-ndjson", "ledger.jsonl": "application/x-ndjson"}
POLL_S = 0.5


def plotly_js() -> Path:
    import plotly

    return Path(plotly.__file__).parent / "package_data" / "plotly.min.js"


class RunView:
    """What the page shows of one run directory, kept current by `refresh()`."""

    def __init__(self, run_dir: Path):
        self.dir = Path(run_dir)
        self.metrics = MetricsFile(self.dir / "metrics.jsonl")
        self._alerts = JsonLines(self.dir / "alerts.jsonl")
        self._ledger = JsonLines(self.dir / "ledger.jsonl")
        self.records: list[dict] = []
        self.alerts: list[dict] = []
        self.ledger = {e: 0 for e in LEDGER_EVENTS}
        self.generation = 0
        """Bumped when metrics.jsonl was rewritten (a resume): the page starts its curves over."""
        self._lock = threading.Lock()

    def refresh(self) -> tuple[list[dict], list[dict]]:
        """(new records, new alerts) since the last call."""
        with self._lock:
            before = self.metrics.records
            new = self.metrics.refresh()
            if self.metrics.records != before + len(new):  # rewritten, and read again from its start
                self.records, self.generation = [], self.generation + 1
            self.records += new
            alerts = self._alerts.new()
            self.alerts += alerts
            ledger_counts(self._ledger.new(), self.ledger)
            return new, alerts

    def state(self) -> dict:
        """Everything but the records: config, summary, ledger counts, checkpoints, artifacts."""
        def read(name):
            try:
                return json.loads((self.dir / name).read_text())
            except (OSError, ValueError):
                return None

        ckpt_dir = self.dir / "checkpoints"
        checkpoints = sorted(p.name for p in ckpt_dir.iterdir() if p.is_dir()) if ckpt_dir.is_dir() else []
        config = read("config.json") or {}
        return {"name": self.dir.name, "config": config, "summary": read("summary.json"), "ledger": dict(self.ledger),
                "checkpoints": checkpoints, "alerts": self.alerts[-50:],
                "artifacts": [a for a in ARTIFACTS if (self.dir / a).is_file()]}


def is_run_dir(path: Path) -> bool:
    return (Path(path) / "config.json").is_file() or (Path(path) / "metrics.jsonl").is_file()


def create_app(path: Path, *, single: bool | None = None):
    """The page of the run in `path`; or, for a directory of runs (`runs/`), a list of them at /
    and each one's page at /runs/NAME/ (runs that appear later are listed too). `single` None:
    a directory of runs when `path` is no run itself and holds one."""
    from fastapi import FastAPI, HTTPException
    from fastapi.responses import FileResponse, HTMLResponse

    path = Path(path)
    app = FastAPI(title="lockstep dashboard", docs_url=None, redoc_url=None, openapi_url=None)
    views: dict[str, RunView] = {}

    def view_of(name: str) -> RunView:
        run = path / name
        if "/" in name or name.startswith(".") or not run.is_dir() or not is_run_dir(run):
            raise HTTPException(404, f"no run {name!r} in {path}")
        if name not in views:
            views[name] = RunView(run)
        return views[name]

    @app.get("/static/plotly.min.js")
    def plotly():
        return FileResponse(plotly_js(), media_type="text/javascript")

    if single is None:
        single = is_run_dir(path) or not (path.is_dir() and any(p.is_dir() and is_run_dir(p) for p in path.iterdir()))
    if single:
        view = RunView(path)
        _run_routes(app, "", lambda name=None: view)
        app.state.view = view
        return app

    @app.get("/", response_class=HTMLResponse)
    def index():
        return RUNS_PAGE.read_text()

    @app.get("/api/runs")
    def runs():
        out = []
        for run in sorted((p for p in path.iterdir() if p.is_dir() and is_run_dir(p)), key=lambda p: p.stat().st_mtime):
            v = view_of(run.name)
            v.refresh()
            last = {k: v.metrics.latest.get(k) for k in ("rollout/reward_mean", "eval/accuracy") if k in v.metrics.latest}
            status = {a.get("rule"): a.get("status") for a in v.alerts}  # each rule's latest event
            out.append({"name": run.name, "step": v.metrics.step, "finished": (run / "summary.json").is_file(),
                        "alerts_firing": sorted(r for r, st in status.items() if st == "firing"),
                        **{k.replace("/", "_"): x for k, x in last.items()}})
        return {"runs": out}

    _run_routes(app, "/runs/{name}", view_of)
    return app


def _run_routes(app, prefix: str, view_for) -> None:
    """A run's page and API under `prefix` (a `{name}` in it selects the run)."""
    from fastapi import HTTPException
    from fastapi.responses import FileResponse, HTMLResponse, StreamingResponse

    def view(name: str | None):
        return view_for(name)

    @app.get(prefix + "/", response_class=HTMLResponse)
    def page(name: str | None = None):
        view(name)
        return PAGE.read_text()

    @app.get(prefix + "/api/run")
    def run_state(name: str | None = None):
        v = view(name)
        v.refresh()
        return {**v.state(), "records": v.records, "alerts_seen": len(v.alerts), "generation": v.generation}

    @app.get(prefix + "/api/events")
    async def events(name: str | None = None, after: int = 0, alerts_after: int = 0):
        """Records past the first `after` (and alerts past `alerts_after`) as they are written:
        each page keeps its own place, so none is missed or sent twice."""
        v = view(name)

        async def stream():
            generation, sent, sent_alerts = v.generation, max(after, 0), max(alerts_after, 0)
            yield "retry: 1000\n\n"
            while True:
                await asyncio.to_thread(v.refresh)
                if v.generation != generation:
                    generation, sent, sent_alerts = v.generation, 0, 0
                    yield "event: reset\ndata: {}\n\n"
                new, alerts = v.records[sent:], v.alerts[sent_alerts:]
                sent, sent_alerts = sent + len(new), sent_alerts + len(alerts)
                for r in new:
                    yield f"event: record\ndata: {json.dumps(r)}\n\n"
                if new or alerts:
                    yield f"event: state\ndata: {json.dumps(v.state())}\n\n"
                await asyncio.sleep(POLL_S)

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.get(prefix + "/artifacts/{artifact}")
    def artifact(artifact: str, name: str | None = None):
        v = view(name)
        if artifact not in ARTIFACTS or not (v.dir / artifact).is_file():
            raise HTTPException(404, f"no artifact {artifact!r} in this run (known: {', '.join(ARTIFACTS)})")
        return FileResponse(v.dir / artifact, media_type=ARTIFACTS[artifact])


def serve(run_dir: Path, port: int, host: str = "127.0.0.1", *, background: bool = False, single: bool | None = None):
    """Serve the dashboard (blocking, or from a daemon thread with `background`); returns the
    uvicorn server."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(create_app(run_dir, single=single), host=host, port=port, log_level="warning"))
    if background:  # (uvicorn installs signal handlers only in the main thread: the run keeps its own)
        threading.Thread(target=server.run, name="dashboard", daemon=True).start()
    else:
        server.run()
    return server
