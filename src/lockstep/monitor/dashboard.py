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

from lockstep.monitor.runfile import MetricsFile

PAGE = Path(__file__).with_name("dashboard.html")
ARTIFACTS = {"report.html": "text/html", "summary.json": "application/json", "metrics.jsonl": "application/x-ndjson",
             "config.json": "application/json", "alerts.jsonl": "application/x-ndjson",
             "trace.jsonl": "application/x-ndjson", "ledger.jsonl": "application/x-ndjson"}
LEDGER_EVENTS = ("issued", "generated", "rewarded", "trained", "filtered")
POLL_S = 0.5


def plotly_js() -> Path:
    import plotly

    return Path(plotly.__file__).parent / "package_data" / "plotly.min.js"


class JsonLines:
    """A JSON-lines file read incrementally, complete lines only (the writer may be mid-line)."""

    def __init__(self, path: Path):
        self.path, self._offset = Path(path), 0

    def new(self) -> list[dict]:
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return []
        if size < self._offset:
            self._offset = 0
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            chunk = f.read(size - self._offset)
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self._offset += len(complete)
        out = []
        for line in complete.splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out


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
            for e in self._ledger.new():
                if e.get("event") in self.ledger and isinstance(e.get("ids"), list):
                    self.ledger[e["event"]] += len(e["ids"])
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


def create_app(run_dir: Path):
    from fastapi import FastAPI, HTTPException
    from fastapi.responses import FileResponse, HTMLResponse, StreamingResponse

    view = RunView(run_dir)
    app = FastAPI(title="lockstep dashboard", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/", response_class=HTMLResponse)
    def page():
        return PAGE.read_text()

    @app.get("/static/plotly.min.js")
    def plotly():
        return FileResponse(plotly_js(), media_type="text/javascript")

    @app.get("/api/run")
    def run_state():
        view.refresh()
        return {**view.state(), "records": view.records, "alerts_seen": len(view.alerts), "generation": view.generation}

    @app.get("/api/events")
    async def events(after: int = 0, alerts_after: int = 0):
        """Records past the first `after` (and alerts past `alerts_after`) as they are written:
        each page keeps its own place, so none is missed or sent twice."""
        async def stream():
            generation, sent, sent_alerts = view.generation, max(after, 0), max(alerts_after, 0)
            yield "retry: 1000\n\n"
            while True:
                await asyncio.to_thread(view.refresh)
                if view.generation != generation:
                    generation, sent, sent_alerts = view.generation, 0, 0
                    yield "event: reset\ndata: {}\n\n"
                new, alerts = view.records[sent:], view.alerts[sent_alerts:]
                sent, sent_alerts = sent + len(new), sent_alerts + len(alerts)
                for r in new:
                    yield f"event: record\ndata: {json.dumps(r)}\n\n"
                if new or alerts:
                    yield f"event: state\ndata: {json.dumps(view.state())}\n\n"
                await asyncio.sleep(POLL_S)

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.get("/artifacts/{name}")
    def artifact(name: str):
        if name not in ARTIFACTS or not (view.dir / name).is_file():
            raise HTTPException(404, f"no artifact {name!r} in this run (known: {', '.join(ARTIFACTS)})")
        return FileResponse(view.dir / name, media_type=ARTIFACTS[name])

    app.state.view = view
    return app


def serve(run_dir: Path, port: int, host: str = "127.0.0.1", *, background: bool = False):
    """Serve the dashboard (blocking, or from a daemon thread with `background`); returns the
    uvicorn server."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(create_app(run_dir), host=host, port=port, log_level="warning"))
    if background:  # (uvicorn installs signal handlers only in the main thread: the run keeps its own)
        threading.Thread(target=server.run, name="dashboard", daemon=True).start()
    else:
        server.run()
    return server
