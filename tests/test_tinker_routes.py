"""Every HTTP route of the installed tinker SDK, read from the SDK's own source, is answered.

The routes are parsed out of the tinker package (every `"/api/v1/..."` string or f-string passed to
an HTTP call, with that call's method), their path parameters filled with ids of real objects this
test creates, and each is sent to the API: none may be a 404 or 405 (or a 5xx). The routes the
server does not answer are those `tinker_api.GATED_ROUTES` lists, and the test checks that the
config route named there switches each off for the SDK.
"""

import ast
import datetime as dt
import functools
import json
import re
from pathlib import Path

import pytest
import tinker
from sqlalchemy import select

from lockstep.cli import build_parser
from lockstep.service.db import Checkpoint, Tenant, Usage
from lockstep.service.tinker_api import GATED_ROUTES
from test_service_api import new_model, post, serving

HTTP_CALLS = {"get": "GET", "post": "POST", "put": "PUT", "delete": "DELETE", "patch": "PATCH"}


def _template(node) -> str | None:
    """'/api/v1/...' from a str constant or an f-string ('{expr}' for each placeholder), else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        text = node.value
    elif isinstance(node, ast.JoinedStr):
        text = "".join(v.value if isinstance(v, ast.Constant) else "{" + ast.unparse(v.value) + "}"
                       for v in node.values)
    else:
        return None
    return text if text.startswith("/api/v1/") else None


@functools.cache
def sdk_routes() -> frozenset[tuple[str, str]]:
    """(METHOD, path template) of every HTTP call in the tinker package (its own tests excluded)."""
    found = set()
    for file in Path(tinker.__file__).parent.rglob("*.py"):
        if file.name.endswith("_test.py") or "tests" in file.parts:
            continue
        for node in ast.walk(ast.parse(file.read_text())):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute) or not node.args:
                continue
            name = node.func.attr.lstrip("_")
            if name in HTTP_CALLS and (path := _template(node.args[0])):
                found.add((HTTP_CALLS[name], path))
            elif name == "request" and len(node.args) >= 2 and (path := _template(node.args[1])):
                method = node.args[0]
                assert isinstance(method, ast.Constant), f"{file}: a request() whose method is not a literal"
                found.add((method.value.upper(), path))
    return frozenset(found)


def test_the_parser_reads_the_sdk_routes():
    """The control for the walk: the parse finds routes of each kind of call site (resources'
    self._post, the public interfaces' client.put/delete, the CLI's _request) and parameters."""
    routes = sdk_routes()
    for expected in [("POST", "/api/v1/client/config"), ("POST", "/api/v1/copy_weights"),
                     ("PUT", "/api/v1/sessions/{session_id}/project"),
                     ("DELETE", "/api/v1/training_runs/{training_run_id}/checkpoints/{checkpoint_id}/publish"),
                     ("GET", "/api/v1/auth/apikey/me"), ("DELETE", "/api/v1/auth/apikey/me"),
                     ("GET", "/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id}/external_weights_urls")]:
        assert expected in routes
    assert len(routes) >= 45, sorted(routes)


@pytest.fixture()
def world(tmp_path, builtin_dir):
    """alice's session, model, sampler and two checkpoints (a training one, an external export),
    committed in storage; (client, sessions, key, ids by path-parameter name)."""
    with serving(tmp_path, builtin_dir) as (client, sessions, key, _other):
        sid, mid = new_model(client, key)
        ssid = post(client, "create_sampling_session", key,
                    {"session_id": sid, "sampling_session_seq_id": 0, "base_model": "lockstep/tiny"}
                    ).json()["sampling_session_id"]
        storage = client.app.state.storage
        with sessions() as s:
            tid = _tenant_id(sessions, key)
            for kind in ("weights", "external_weights"):
                key_ = f"checkpoints/{tid}/test/{kind}/ck"
                local = tmp_path / kind
                local.mkdir()
                (local / "adapter.safetensors").write_bytes(b"weights")
                (local / "MANIFEST.json").write_text("{}")
                storage.put_dir(local, key_)
                s.add(Checkpoint(tenant_id=tid, model_id=mid, kind=kind, name="ck", storage_path=key_, size_bytes=7))
            s.commit()
        ids = {"session_id": sid, "model_id": mid, "training_run_id": mid, "sampler_id": ssid,
               "sampling_session_id": ssid, "checkpoint_id": "weights/ck"}
        yield client, sessions, key, ids


def _tenant_id(sessions, key):
    from lockstep.service.tenants import authenticate

    with sessions() as s:
        return authenticate(s, key).id


def _fill(template: str, ids: dict) -> str:
    path = re.sub(r"\{(\w+)\}", lambda m: ids[m.group(1)], template)
    if path.endswith("/external_weights_urls"):
        path = path.replace("weights/ck", "external_weights/ck")
    return path


def _order(route):
    """Deleting the checkpoint goes after the routes that read it; revoking the key goes last."""
    method, path = route
    deleting = method == "DELETE"
    revoking = deleting and path == "/api/v1/auth/apikey/me"
    return (revoking, deleting and path.endswith("{checkpoint_id}"), deleting, path)


def test_every_sdk_route_is_answered(world):
    client, _, key, ids = world
    answered = []
    for method, template in sorted(sdk_routes(), key=_order):
        if f"{method} {template}" in GATED_ROUTES:
            continue
        path = _fill(template, ids)
        r = client.request(method, path, headers={"X-API-Key": key}, json={} if method in ("POST", "PUT") else None)
        answered.append((method, path, r.status_code))
        assert r.status_code not in (404, 405) and r.status_code < 500, f"{method} {path}: {r.status_code} {r.text}"
    assert len(answered) >= 40


def test_each_gated_route_is_switched_off_by_the_config_the_sdk_reads(world):
    client, _, key, _ = world
    routes = {f"{m} {p}" for m, p in sdk_routes()}
    for route, (config_route, flag, off) in GATED_ROUTES.items():
        assert route in routes, f"{route} is no route of this SDK: take it off GATED_ROUTES"
        answer = post(client, config_route, key, {"sdk_version": tinker.__version__}).json()
        assert answer[flag] == off, f"{config_route} enables {flag}, so the SDK calls {route}: answer it"


def test_admin_routes_answer_for_the_callers_own_tenant(world):
    client, _, key, _ = world
    h = {"X-API-Key": key}
    me = client.get("/api/v1/auth/apikey/me", headers=h).json()
    assert me["name"] == "alice" and me["details"]["org_details"]["name"] == "alice"
    r = client.get("/api/v1/audit", headers=h)
    assert r.status_code == 403 and "operator" in r.json()["error"]
    usage = client.get("/api/v1/billing/usage/checkpoints/current", headers=h).json()["data"]
    assert [(u["checkpoint_count"], u["size_bytes"]) for u in usage] == [(2, 14)]
    hour = dt.datetime.now(dt.timezone.utc).replace(minute=0, second=0, microsecond=0)
    window = {"starting_on": (hour - dt.timedelta(hours=2)).isoformat(), "ending_before": hour.isoformat()}
    assert client.get("/api/v1/billing/usage/events", headers=h, params=window).json()["data"] == []
    bad = client.get("/api/v1/billing/usage/events", headers=h,
                     params={**window, "ending_before": (hour + dt.timedelta(days=15)).isoformat()})
    assert bad.status_code == 400 and "14 days" in bad.json()["error"]
    assert client.delete("/api/v1/auth/apikey/me", headers=h).status_code == 200
    assert client.get("/api/v1/auth/apikey/me", headers=h).status_code == 401  # revoked, at once here


def test_billing_events_are_the_tenants_own_metered_tokens_by_hour(world):
    client, sessions, key, _ = world
    hour = (dt.datetime.now(dt.timezone.utc) - dt.timedelta(hours=3)).replace(minute=0, second=0, microsecond=0,
                                                                              tzinfo=None)
    with sessions() as s:
        alice = _tenant_id(sessions, key)
        bob = s.scalar(select(Tenant.id).where(Tenant.name == "bob"))
        at = lambda minutes: hour + dt.timedelta(minutes=minutes)  # noqa: E731
        s.add_all([Usage(tenant_id=alice, kind="tokens_trained", amount=10, created_at=at(5)),
                   Usage(tenant_id=alice, kind="tokens_trained", amount=5, created_at=at(55)),
                   Usage(tenant_id=alice, kind="tokens_sampled", amount=7, created_at=at(61)),
                   Usage(tenant_id=alice, kind="compute_seconds", amount=3.5, created_at=at(5)),
                   Usage(tenant_id=bob, kind="tokens_trained", amount=1000, created_at=at(5)),
                   Usage(tenant_id=alice, kind="tokens_trained", amount=99, created_at=at(180))])  # after the window
        s.commit()
    window = {"starting_on": hour.isoformat() + "Z", "ending_before": (hour + dt.timedelta(hours=3)).isoformat() + "Z"}
    data = client.get("/api/v1/billing/usage/events", headers={"X-API-Key": key}, params=window).json()["data"]
    got = [(x["bucket_start"][11:16], x["event_info"]["type"], x["event_info"]["token_count"]) for x in data]
    h0, h1 = hour.strftime("%H:00"), (hour + dt.timedelta(hours=1)).strftime("%H:00")
    assert got == [(h0, "training", 15), (h1, "sampling_sample", 7)]
    r = client.get("/api/v1/billing/usage/events", headers={"X-API-Key": key},
                   params={**window, "starting_on": (hour + dt.timedelta(minutes=30)).isoformat()})
    assert r.status_code == 400 and "starting_on must be on a UTC hour boundary" in r.json()["error"]


def test_the_operator_rotates_a_revoked_key(world, capsys):
    client, sessions, key, _ = world
    assert client.delete("/api/v1/auth/apikey/me", headers={"X-API-Key": key}).status_code == 200
    db_url = str(sessions.kw["bind"].url)
    args = build_parser().parse_args(["tenants", "rotate-key", "alice", "--db", db_url, "--json"])
    assert args.func(args) == 0
    new = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["api_key"]
    assert client.get("/api/v1/auth/apikey/me", headers={"X-API-Key": new}).json()["name"] == "alice"
    assert client.get("/api/v1/auth/apikey/me", headers={"X-API-Key": key}).status_code == 401
    args = build_parser().parse_args(["tenants", "rotate-key", "nobody", "--db", db_url])
    assert args.func(args) == 2 and "no tenant 'nobody'" in capsys.readouterr().err
