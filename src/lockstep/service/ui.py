"""The service's web pages: /ui (sign in with an API key, your jobs and your share of the service)
and /ui/jobs/ID (a job's live page: monitor/dashboard.html, fed by the tenant's /v1 API).

The pages are static; every number on them comes from the /v1 API with the API key the browser
keeps for the session (sessionStorage), so a page shows exactly what that key may read: another
tenant's job is a 404 there as everywhere.

Each page carries a Content-Security-Policy that lets run only its own scripts: plotly.js from
this server and its inline script, allowed by hash, so a script that got into the page another way
(or into a report opened from it: a blob inherits the page's policy) does not run. Styles may be
inline: plotly sets them on every element it draws.
"""

from __future__ import annotations

import base64
import hashlib
import re
from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, HTMLResponse

from lockstep.monitor import dashboard

router = APIRouter()
INDEX = Path(dashboard.__file__).with_name("ui.html")
INLINE_SCRIPT = re.compile(r"<script>(.*?)</script>", re.DOTALL)
"""Our own pages' inline scripts (no attributes on their tags); only our static files are matched."""


def page_csp(html: str) -> str:
    """The policy of one of our pages: its inline scripts by sha256, scripts and data from here."""
    hashes = " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(s.encode()).digest()).decode()}'"
                      for s in INLINE_SCRIPT.findall(html))
    return (f"default-src 'none'; script-src 'self' {hashes}; style-src 'self' 'unsafe-inline'; "
            "img-src 'self' data: blob:; connect-src 'self'; font-src 'self' data:; base-uri 'none'; "
            "form-action 'self'; frame-ancestors 'none'")


def page(path: Path) -> HTMLResponse:
    html = path.read_text()
    return HTMLResponse(html, headers={"Content-Security-Policy": page_csp(html)})


@router.get("/ui", response_class=HTMLResponse, include_in_schema=False)
def index():
    return page(INDEX)


@router.get("/ui/jobs/{job_id}", response_class=HTMLResponse, include_in_schema=False)
def job_page(job_id: str):
    return page(dashboard.PAGE)


@router.get("/static/plotly.min.js", include_in_schema=False)
def plotly():
    return FileResponse(dashboard.plotly_js(), media_type="text/javascript")
