"""A hostile tenant against the Tinker API: tenant B tries to reach tenant A's objects (runs,
checkpoints, sampling sessions, futures, sessions) by id and by path, with traversal, encoded
traversal, absolute paths and odd unicode in every path-like field. Every attempt is a 4xx (a 404
where it names an object: another tenant's object looks exactly like a missing one), and A's
objects are unchanged afterwards. Real API and Executor, in this process, on SQLite."""

import http.client
import json
from urllib.parse import quote, urlsplit

import pytest
import requests
from sqlalchemy import func, select

from lockstep.service.db import Checkpoint, Model, Request, SamplingSession, Session
from lockstep.service.tenants import create_tenant
from service_fuzzing import call, in_process_service, make_objects, sft_body

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")


@pytest.fixture(scope="module")
def world(tmp_path_factory, builtin_dir):
    home = tmp_path_factory.mktemp("hostile")
    with in_process_service(home, {"lockstep/tiny": builtin_dir}) as (url, sessions):
        with sessions() as s:
            key_a, key_b = create_tenant(s, "alice")[1], create_tenant(s, "bob")[1]
        a = make_objects(url, key_a)
        b_session = call(url, key_b, "create_session", {})["session_id"]
        b_model = call(url, key_b, "create_model", {"session_id": b_session, "model_seq_id": 0,
                                                    "lora_config": {"rank": 4}, "base_model": "lockstep/tiny"})
        b_model = b_model["model_id"]
        yield url, sessions, key_a, key_b, a, b_session, b_model


_ASCII = "".join(chr(c) for c in range(33, 127))


def raw(url: str, key: str, method: str, path: str, body: dict | bytes | None = None) -> tuple[int, dict]:
    """A request whose path goes out byte for byte (clients would normalise ../ away)."""
    host = urlsplit(url)
    conn = http.client.HTTPConnection(host.hostname, host.port, timeout=30)
    headers = {"X-API-Key": key}
    if isinstance(body, bytes):
        headers["Content-Type"] = "application/x-protobuf"
    elif body is not None:
        headers["Content-Type"], body = "application/json", json.dumps(body).encode()
    conn.request(method, quote(path, safe=_ASCII), body=body, headers=headers)  # only non-ASCII is %-encoded
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    try:
        return resp.status, json.loads(data)
    except ValueError:
        return resp.status, {"raw": data[:200]}


TRAVERSAL_NAMES = ["../x", "..", "/etc/passwd", "ck/../../x", "%2e%2e%2fx", "..%2f..%2fx", "ck\x00", "\uff0e\uff0e",
                   "ck\u202egnp.", "C:\\x", "~/x", "ck\n", "."]
"""Checkpoint names that must never leave the tenant's own directory (or be accepted at all)."""


def attempts(a, b_session, b_model):
    """(what, method, path, body) of tenant B against tenant A; {A...} placeholders are A's ids."""
    m, s, ss, w, sp = a.model_id, a.session_id, a.sampler_id, a.weights_path, a.sampler_path
    out = [
        ("run", "GET", f"/api/v1/training_runs/{quote(m)}", None),
        ("run checkpoints", "GET", f"/api/v1/training_runs/{quote(m)}/checkpoints", None),
        ("delete checkpoint", "DELETE", f"/api/v1/training_runs/{quote(m)}/checkpoints/weights/ck", None),
        ("delete sampler checkpoint", "DELETE", f"/api/v1/training_runs/{quote(m)}/checkpoints/sampler_weights/s",
         None),
        ("weights_info", "POST", "/api/v1/weights_info", {"tinker_path": w}),
        ("load_weights creating a model", "POST", "/api/v1/load_weights",
         {"path": w, "session_id": b_session, "model_seq_id": 7}),
        ("load_weights into B's model", "POST", "/api/v1/load_weights", {"path": w, "model_id": b_model, "seq_id": 1}),
        ("sampling session from A's sampler path", "POST", "/api/v1/create_sampling_session",
         {"session_id": b_session, "sampling_session_seq_id": 3, "model_path": sp}),
        ("sampling session from A's training path", "POST", "/api/v1/create_sampling_session",
         {"session_id": b_session, "sampling_session_seq_id": 4, "model_path": w}),
        ("get_sampler", "GET", f"/api/v1/samplers/{quote(ss)}", None),
        ("asample", "POST", "/api/v1/asample",
         {"sampling_session_id": ss, "prompt": {"chunks": [{"tokens": [5, 6]}]}, "sampling_params": {"max_tokens": 2}}),
        ("retrieve_future", "POST", "/api/v1/retrieve_future", {"request_id": a.request_id}),
        ("session_info", "GET", f"/api/v1/sessions/{s}", None),
        ("heartbeat", "POST", "/api/v1/session_heartbeat", {"session_id": s}),
        ("finish", "POST", f"/api/v1/sessions/{s}/finish", {}),
        ("create_model in A's session", "POST", "/api/v1/create_model",
         {"session_id": s, "model_seq_id": 9, "base_model": "lockstep/tiny"}),
        ("sampling session in A's session", "POST", "/api/v1/create_sampling_session",
         {"session_id": s, "sampling_session_seq_id": 9, "base_model": "lockstep/tiny"}),
        ("get_info", "POST", "/api/v1/get_info", {"model_id": m}),
        ("forward_backward", "POST", "/api/v1/forward_backward", sft_body(m, 5)),
        ("optim_step", "POST", "/api/v1/optim_step", {"model_id": m, "seq_id": 5}),
        ("invalid optim_step (would settle A's seq)", "POST", "/api/v1/optim_step",
         {"model_id": m, "seq_id": 5, "adam_params": {"beta1": 7}}),
        ("save_weights", "POST", "/api/v1/save_weights", {"model_id": m, "seq_id": 5, "path": "stolen"}),
        ("ephemeral sampler of A's model", "POST", "/api/v1/save_weights_for_sampler",
         {"model_id": m, "seq_id": 5, "sampling_session_seq_id": 1}),
        ("load_weights into A's model", "POST", "/api/v1/load_weights", {"path": w, "model_id": m, "seq_id": 5}),
        ("publish", "POST", f"/api/v1/training_runs/{quote(m)}/checkpoints/weights/ck/publish", None),
        ("unpublish", "DELETE", f"/api/v1/training_runs/{quote(m)}/checkpoints/weights/ck/publish", None),
        ("ttl", "PUT", f"/api/v1/training_runs/{quote(m)}/checkpoints/weights/ck/ttl", {"ttl_seconds": 3600}),
        ("external_weights_urls", "GET",
         f"/api/v1/training_runs/{quote(m)}/checkpoints/weights/ck/external_weights_urls", None),
        ("copy_weights", "POST", "/api/v1/copy_weights", {"source_path": w, "destination_project_id": "p"}),
        ("copy_weights into A's session", "POST", "/api/v1/copy_weights",
         {"source_path": w, "session_id": s, "model_seq_id": 11}),
        ("save_weights_external", "POST", "/api/v1/save_weights_external", {"model_id": m, "seq_id": 5, "path": "x"}),
        ("session project", "PUT", f"/api/v1/sessions/{s}/project", {"project_id": "p"}),
        ("trace_export", "GET", f"/api/v1/sessions/{s}/trace_export", None),
    ]
    for p in (f"tinker://{m}/weights/../../x", f"tinker://{m}/weights/%2e%2e", "tinker://../weights/ck",
              f"tinker://{m}/../{m}/weights/ck", "tinker:///etc/passwd", "/etc/passwd", "file:///etc/passwd",
              f"tinker://{m}/weights/ck\u0000", f"tinker://{m}/weights/ck\u202e", f"tinker://{m}/weights/\uff43\uff4b",
              f"tinker://{m.upper()}/weights/ck", f"tinker://{m}/weights/ck/"):
        out.append((f"path {p!r}", "POST", "/api/v1/weights_info", {"tinker_path": p}))
        out.append((f"sampling path {p!r}", "POST", "/api/v1/create_sampling_session",
                    {"session_id": b_session, "sampling_session_seq_id": 5, "model_path": p}))
    for n in TRAVERSAL_NAMES:
        out.append((f"save name {n!r}", "POST", "/api/v1/save_weights", {"model_id": b_model, "seq_id": 2, "path": n}))
    for cid in ("weights/../../../etc/passwd", "weights/%2e%2e%2f%2e%2e", "../weights/ck", "weights//ck",
                "weights/ck/..", "sampler_weights/..%2fck", "/etc/passwd", "weights/\uff43\uff4b"):
        out.append((f"checkpoint_id {cid!r}", "DELETE", f"/api/v1/training_runs/{quote(b_model)}/checkpoints/{cid}",
                    None))
        out.append((f"A's run, checkpoint_id {cid!r}", "DELETE", f"/api/v1/training_runs/{quote(m)}/checkpoints/{cid}",
                    None))
    for mid in (f"../{m}", f"{m}/../{m}", m.upper(), f"{m}\u0000", f" {m}", f"{m}%00", "%2e%2e%2f" + m):
        out.append((f"model id {mid!r}", "POST", "/api/v1/get_info", {"model_id": mid}))
        out.append((f"run path {mid!r}", "GET", f"/api/v1/training_runs/{mid}", None))
    for sid in ("..", "%2e%2e", f"{s}%00", f"../sessions/{s}", s.upper()):
        out.append((f"session path {sid!r}", "GET", f"/api/v1/sessions/{sid}", None))
    return out


def snapshot(sessions, a) -> dict:
    """Everything of A's that B could have changed."""
    with sessions() as s:
        model = s.get(Model, a.model_id)
        session = s.get(Session, a.session_id)
        return {"checkpoints": sorted((c.kind, c.name, c.storage_path, c.public, c.expires_at) for c in s.scalars(
                    select(Checkpoint).where(Checkpoint.model_id == a.model_id))),
                "requests": s.scalar(select(func.count()).select_from(Request).where(Request.model_id == a.model_id)),
                "done_seq": model.done_seq, "finished": session.finished_at, "heartbeat": session.last_heartbeat,
                "project": session.project_id,
                "samplers": s.scalar(select(func.count()).select_from(SamplingSession)
                                     .where(SamplingSession.session_id == a.session_id))}


def test_tenant_b_cannot_reach_tenant_a(world):
    url, sessions, key_a, key_b, a, b_session, b_model = world
    before = snapshot(sessions, a)
    tried = attempts(a, b_session, b_model)
    assert len(tried) >= 30
    answers = {what: raw(url, key_b, method, path, body) for what, method, path, body in tried}
    wrong = {what: got for what, got in answers.items() if not 400 <= got[0] < 500}
    assert not wrong, wrong
    for what in ("run", "run checkpoints", "delete checkpoint", "weights_info", "get_sampler", "asample",
                 "retrieve_future", "session_info", "heartbeat", "finish", "get_info", "forward_backward",
                 "optim_step", "save_weights",
                 "ephemeral sampler of A's model", "load_weights into A's model", "load_weights into B's model",
                 "sampling session from A's sampler path", "create_model in A's session", "publish", "unpublish",
                 "ttl", "external_weights_urls", "copy_weights", "copy_weights into A's session",
                 "save_weights_external", "session project", "trace_export"):
        assert answers[what][0] == 404, (what, answers[what])
    assert snapshot(sessions, a) == before  # nothing of A's moved
    storage = a.weights_path  # and A still trains, saves and samples
    call(url, key_a, "forward_backward", sft_body(a.model_id, 5))
    assert call(url, key_a, "weights_info", {"tinker_path": storage})["base_model"] == "lockstep/tiny"


def test_another_tenants_object_looks_exactly_like_a_missing_one(world):
    url, _, key_a, key_b, a, _, _ = world
    for path, body, field in (("retrieve_future", {"request_id": a.request_id}, "request_id"),
                              ("get_info", {"model_id": a.model_id}, "model_id"),
                              ("session_heartbeat", {"session_id": a.session_id}, "session_id"),
                              ("weights_info", {"tinker_path": a.weights_path}, "tinker_path")):
        real_id = a.model_id if field == "tinker_path" else body[field]
        fake = body[field].replace(real_id, "f" * 16 + real_id[16:])  # the same shape, no such object
        theirs = raw(url, key_b, "POST", f"/api/v1/{path}", body)
        missing = raw(url, key_b, "POST", f"/api/v1/{path}", {field: fake})
        assert theirs[0] == missing[0] == 404
        assert theirs[1]["error"].replace(body[field], "X") == missing[1]["error"].replace(fake, "X"), (theirs, missing)


def test_listings_show_only_the_callers_objects(world):
    url, _, _, key_b, a, b_session, b_model = world
    headers = {"X-API-Key": key_b}
    runs = requests.get(f"{url}/api/v1/training_runs?limit=1000", headers=headers, timeout=30).json()
    assert [r["training_run_id"] for r in runs["training_runs"]] == [b_model]
    checkpoints = requests.get(f"{url}/api/v1/checkpoints", headers=headers, timeout=30).json()["checkpoints"]
    assert all(a.model_id not in c["tinker_path"] for c in checkpoints)
    assert requests.get(f"{url}/api/v1/sessions", headers=headers, timeout=30).json()["sessions"] == [b_session]
