"""The service's web pages: /ui (sign in with an API key, your jobs and your share of the service)
and /ui/jobs/ID (a job's live page: monitor/dashboard.html, fed by the tenant's /v1 API).

The pages are static; every number on them comes from the /v1 API with the API key the browser
keeps for the session (sessionStorage), so a page shows exactly what that key may read: another
tenant's job is a 404 there as everywhere.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, HTMLResponse

from lockstep.monitor import dashboard

router = APIRouter()
INDEX = Path(dashboard.__file__).with_name("ui.html")


@router.get("/ui", response_class=HTMLResponse, include_in_schema=False)
def index():
    return INDEX.read_text()


@router.get("/ui/jobs/{job_id}", response_class=HTMLResponse, include_in_schema=False)
def job_page(job_id: str):
    return dashboard.PAGE.read_text()


@router.get("/static/plotly.min.js", include_in_schema=False)
def plotly():
    return FileResponse(dashboard.plotly_js(), media_type="text/javascript")
