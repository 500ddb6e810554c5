"""Checkpoint and session management routes, each with two tenants: publish, TTL (and the janitor),
copy_weights, external-weights signed URLs, sessions/search, project, trace_export.

The API runs in-process with no worker: checkpoints are committed to storage and their rows
written here, as a worker's save would leave them.
"""

import base64
import datetime as dt
from urllib.parse import parse_qs, urlencode, urlsplit

import pytest
from sqlalchemy import select

from lockstep.service import janitor, signed_urls
from lockstep.service.db import Checkpoint, Session
from lockstep.service.tenants import authenticate
from test_service_api import new_model, post, serving
from test_service_backends import s3  # noqa: F401 - a fixture


def add_checkpoint(client, sessions, key, model_id, kind="weights", name="ck", files=None, tmp=None) -> str:
    """A committed checkpoint of `model_id` (files: name -> bytes), as a save leaves it; its tinker:// path."""
    storage = client.app.state.storage
    files = files or {"adapter.safetensors": b"weights of " + name.encode()}
    with sessions() as s:
        tid = authenticate(s, key).id
        storage_key = f"checkpoints/{tid}/test-{model_id.replace(':', '_')}/{kind}/{name}"
        local = tmp / f"{model_id.replace(':', '_')}-{kind}-{name}"
        local.mkdir(parents=True)
        for fname, data in {**files, "MANIFEST.json": b"{}"}.items():
            (local / fname).parent.mkdir(parents=True, exist_ok=True)
            (local / fname).write_bytes(data)
        storage.put_dir(local, storage_key)
        s.add(Checkpoint(tenant_id=tid, model_id=model_id, kind=kind, name=name, storage_path=storage_key,
                         size_bytes=sum(len(v) for v in files.values())))
        s.commit()
    return f"tinker://{model_id}/{kind}/{name}"


@pytest.fixture()
def two(tmp_path, builtin_dir):
    """alice with a session, a model and its checkpoint weights/ck; bob with a session."""
    with serving(tmp_path, builtin_dir) as (client, sessions, alice, bob):
        sid, mid = new_model(client, alice)
        path = add_checkpoint(client, sessions, alice, mid, tmp=tmp_path)
        bob_sid = post(client, "create_session", bob, {"tags": []}).json()["session_id"]
        yield {"client": client, "sessions": sessions, "alice": alice, "bob": bob, "sid": sid, "mid": mid,
               "path": path, "bob_sid": bob_sid, "tmp": tmp_path}


def h(key):
    return {"X-API-Key": key}


def reads(w, key, path, seq=0) -> dict:
    """What a tenant can do with a checkpoint it does not own: status of each read."""
    c = w["client"]
    sid = w["bob_sid"] if key == w["bob"] else w["sid"]
    return {"sample": post(c, "create_sampling_session", key, {"session_id": sid, "sampling_session_seq_id": seq,
                                                               "model_path": path}).status_code,
            "weights_info": post(c, "weights_info", key, {"tinker_path": path}).status_code,
            "load": post(c, "load_weights", key, {"path": path, "session_id": sid,
                                                  "model_seq_id": 100 + seq}).status_code,
            "copy": post(c, "copy_weights", key, {"source_path": path, "session_id": sid,
                                                  "model_seq_id": 200 + seq}).status_code}


def ck_url(w, suffix="", run=None, cid="weights/ck"):
    return f"/api/v1/training_runs/{run or w['mid']}/checkpoints/{cid}{suffix}"


# -- publish -------------------------------------------------------------------------------------
def test_an_unpublished_checkpoint_stays_private_and_a_published_one_is_readable_by_path(two):
    w, c = two, two["client"]
    assert set(reads(w, w["bob"], w["path"], 0).values()) == {404}
    assert c.post(ck_url(w, "/publish"), headers=h(w["bob"])).status_code == 404  # only the owner publishes
    assert c.post(ck_url(w, "/publish"), headers=h(w["alice"])).status_code == 200
    assert c.post(ck_url(w, "/publish"), headers=h(w["alice"])).status_code == 409
    # The control: the same reads of the same path now work for bob.
    assert reads(w, w["bob"], w["path"], 1) == {"sample": 200, "weights_info": 200, "load": 200, "copy": 200}
    # Reads only: bob cannot list it, delete it, set its TTL, unpublish it or get its URLs.
    listed = c.get("/api/v1/checkpoints", headers=h(w["bob"])).json()["checkpoints"]
    assert w["path"] not in [x["tinker_path"] for x in listed if x["tinker_path"].startswith(f"tinker://{w['mid']}")]
    assert c.delete(ck_url(w), headers=h(w["bob"])).status_code == 404
    assert c.put(ck_url(w, "/ttl"), headers=h(w["bob"]), json={"ttl_seconds": 3600}).status_code == 404
    assert c.delete(ck_url(w, "/publish"), headers=h(w["bob"])).status_code == 404
    mine = c.get(f"/api/v1/training_runs/{w['mid']}/checkpoints", headers=h(w["alice"])).json()["checkpoints"]
    assert [x["public"] for x in mine] == [True]
    assert c.delete(ck_url(w, "/publish"), headers=h(w["alice"])).status_code == 200
    assert c.delete(ck_url(w, "/publish"), headers=h(w["alice"])).status_code == 409
    assert set(reads(w, w["bob"], w["path"], 2).values()) == {404}


# -- TTL -----------------------------------------------------------------------------------------
def test_a_ttl_set_by_the_owner_is_honoured_by_the_janitor(two, monkeypatch):
    w, c = two, two["client"]
    for bad in (10, 11 * 366 * 86400, "x"):
        r = c.put(ck_url(w, "/ttl"), headers=h(w["alice"]), json={"ttl_seconds": bad})
        assert r.status_code == 400 and "ttl_seconds" in r.json()["error"]
    # The expiry is an hour from when the request was served: between the clock read just before it
    # and just after it (the store keeps whole seconds at least), however long the request took.
    before = dt.datetime.now(dt.timezone.utc).replace(microsecond=0)
    assert c.put(ck_url(w, "/ttl"), headers=h(w["alice"]), json={"ttl_seconds": 3600}).status_code == 200
    after = dt.datetime.now(dt.timezone.utc)
    [ck] = c.get("/api/v1/checkpoints", headers=h(w["alice"])).json()["checkpoints"]
    expires = dt.datetime.fromisoformat(ck["expires_at"])
    assert before + dt.timedelta(seconds=3600) <= expires <= after + dt.timedelta(seconds=3600)
    with w["sessions"]() as s:
        key = s.scalar(select(Checkpoint.storage_path))
    storage = c.app.state.storage
    assert janitor.sweep(w["sessions"], storage, session_ttl_s=1e9).checkpoints == 0  # not yet
    later = janitor.now() + dt.timedelta(seconds=3601)
    monkeypatch.setattr(janitor, "now", lambda: later)
    assert janitor.sweep(w["sessions"], storage, session_ttl_s=1e9).checkpoints == 1
    assert not storage.exists(key) and c.get("/api/v1/checkpoints", headers=h(w["alice"])).json()["checkpoints"] == []


def test_a_ttl_of_none_removes_the_expiry(two):
    w, c = two, two["client"]
    c.put(ck_url(w, "/ttl"), headers=h(w["alice"]), json={"ttl_seconds": 7200})
    assert c.put(ck_url(w, "/ttl"), headers=h(w["alice"]), json={"ttl_seconds": None}).status_code == 200
    assert c.get("/api/v1/checkpoints", headers=h(w["alice"])).json()["checkpoints"][0]["expires_at"] is None


# -- copy_weights --------------------------------------------------------------------------------
def test_a_copy_shares_storage_outlives_its_source_and_cannot_be_trained(two):
    w, c = two, two["client"]
    body = {"source_path": w["path"], "session_id": w["sid"], "model_seq_id": 5, "ttl_seconds": 3600}
    r = post(c, "copy_weights", w["alice"], body)
    assert r.status_code == 200, r.text
    copy = r.json()["tinker_path"]
    assert copy == f"tinker://{w['sid']}:train:5/weights/ck"
    assert post(c, "copy_weights", w["alice"], body).json()["tinker_path"] == copy  # a retry: the same copy
    taken = post(c, "copy_weights", w["alice"], {**body, "source_path": copy})
    assert taken.status_code == 409 and "model_seq_id" in taken.json()["error"]
    with w["sessions"]() as s:
        keys = set(s.scalars(select(Checkpoint.storage_path)))
    assert len(keys) == 1  # no bytes duplicated
    refused = post(c, "optim_step", w["alice"], {"model_id": f"{w['sid']}:train:5", "seq_id": 1})
    assert refused.status_code == 400 and "cannot be trained" in refused.json()["error"]
    assert c.delete(ck_url(w), headers=h(w["alice"])).status_code == 200
    assert c.app.state.storage.has_dir(keys.pop())  # the copy still points at it
    assert post(c, "weights_info", w["alice"], {"tinker_path": copy}).status_code == 200
    runs = c.get("/api/v1/training_runs", headers=h(w["alice"])).json()["training_runs"]
    assert f"{w['sid']}:train:5" in [r["training_run_id"] for r in runs]


def test_a_copy_into_a_project_and_the_copy_refusals(two):
    w, c = two, two["client"]
    r = post(c, "copy_weights", w["alice"], {"source_path": w["path"], "destination_project_id": "archive"})
    assert r.status_code == 200, r.text
    run = r.json()["tinker_path"].split("/")[2]
    with w["sessions"]() as s:
        assert s.get(Session, run.split(":")[0]).project_id == "archive"
    for body, match in [({"source_path": w["path"]}, "destination_project_id"),
                        ({"source_path": w["path"], "session_id": w["sid"]}, "model_seq_id"),
                        ({"source_path": w["path"], "destination_project_id": "p", "weights_access_token": "t"},
                         "weights_access_token"),
                        ({"source_path": "tinker://nope", "destination_project_id": "p"}, "tinker://")]:
        r = post(c, "copy_weights", w["alice"], body)
        assert r.status_code == 400 and match in r.json()["error"], (body, r.text)
    # bob's copy of alice's unpublished checkpoint, into bob's session or alice's: 404 either way
    to_project = {"source_path": w["path"], "destination_project_id": "p"}
    assert post(c, "copy_weights", w["bob"], to_project).status_code == 404
    assert post(c, "copy_weights", w["bob"], {"source_path": w["path"], "session_id": w["sid"],
                                              "model_seq_id": 9}).status_code == 404


# -- external weights: signed URLs ---------------------------------------------------------------
@pytest.fixture()
def export(two):
    """alice's external_weights/ex (two files) and its URLs."""
    w = two
    w["ex"] = add_checkpoint(w["client"], w["sessions"], w["alice"], w["mid"], "external_weights", "ex",
                             {"adapter_model.safetensors": b"A" * 100, "adapter_config.json": b'{"r": 4}'},
                             tmp=w["tmp"])
    r = w["client"].get(ck_url(w, "/external_weights_urls", cid="external_weights/ex"), headers=h(w["alice"]))
    assert r.status_code == 200, r.text
    w["urls"] = r.json()
    return w


def _get(client, url):
    """A signed URL fetched as the SDK does: no API key."""
    parts = urlsplit(url)
    return client.get(f"{parts.path}?{parts.query}")


def test_signed_urls_download_each_file_of_the_owners_export_without_a_key(export):
    w, c = export, export["client"]
    urls = w["urls"]["urls"]
    assert set(urls) == {"adapter_model.safetensors", "adapter_config.json", "MANIFEST.json"}
    assert _get(c, urls["adapter_model.safetensors"]).content == b"A" * 100
    assert _get(c, urls["adapter_config.json"]).content == b'{"r": 4}'
    expires = dt.datetime.fromisoformat(w["urls"]["expires"])
    assert dt.timedelta(minutes=59) < expires - dt.datetime.now(dt.timezone.utc) <= dt.timedelta(hours=1)


def test_an_expired_url_is_refused(export, monkeypatch):
    w, c = export, export["client"]
    url = w["urls"]["urls"]["adapter_model.safetensors"]
    expires = int(parse_qs(urlsplit(url).query)["e"][0])
    monkeypatch.setattr(signed_urls, "clock", lambda: expires - 1)
    assert _get(c, url).status_code == 200  # the control: the same URL, a second before
    monkeypatch.setattr(signed_urls, "clock", lambda: expires)
    r = _get(c, url)
    assert r.status_code == 403 and "expired" in r.json()["error"]


def _with(url, **changes) -> str:
    parts = urlsplit(url)
    query = {k: v[0] for k, v in parse_qs(parts.query).items()}
    return f"{parts.path}?{urlencode({**query, **changes})}"


def test_a_tampered_url_is_refused_and_one_objects_url_fetches_no_other(export):
    w, c = export, export["client"]
    url = w["urls"]["urls"]["adapter_model.safetensors"]
    q = {k: v[0] for k, v in parse_qs(urlsplit(url).query).items()}
    obj = base64.urlsafe_b64decode(q["o"] + "=" * (-len(q["o"]) % 4)).decode()
    assert c.get(_with(url)).status_code == 200  # the control: the URL rebuilt unchanged works
    flipped = q["s"][:-1] + ("0" if q["s"][-1] != "0" else "1")
    other = obj.replace("adapter_model.safetensors", "adapter_config.json")
    alices_weights = f"storage:{obj.split(':', 1)[1].split('/external_weights/')[0]}/weights/ck/adapter.safetensors"
    for changed in ({"s": flipped}, {"e": str(int(q["e"]) + 3600)},
                    {"o": base64.urlsafe_b64encode(other.encode()).decode()},
                    {"o": base64.urlsafe_b64encode(alices_weights.encode()).decode()},
                    {"o": "%%%"}, {"s": ""}, {"s": "\x80"}, {"s": "é" * 64}):
        r = c.get(_with(url, **changed))
        assert r.status_code == 403, (changed, r.text)


def test_urls_are_signed_only_for_the_callers_own_exports(export):
    w, c = export, export["client"]
    assert c.get(ck_url(w, "/external_weights_urls", cid="external_weights/ex"), headers=h(w["bob"])).status_code == 404
    c.post(ck_url(w, "/publish", cid="external_weights/ex"), headers=h(w["alice"]))
    assert c.get(ck_url(w, "/external_weights_urls", cid="external_weights/ex"), headers=h(w["bob"])).status_code == 404
    r = c.get(ck_url(w, "/external_weights_urls"), headers=h(w["alice"]))  # a training checkpoint
    assert r.status_code == 400 and "save_weights_external" in r.json()["error"]
    assert c.get("/api/v1/signed", params={"o": "x"}).status_code == 400  # e and s missing


def test_save_weights_external_is_queued_for_the_owners_model_only(two):
    w, c = two, two["client"]
    body = {"model_id": w["mid"], "seq_id": 1, "path": "final", "type": "save_weights_external"}
    assert post(c, "save_weights_external", w["bob"], body).status_code == 404
    r = post(c, "save_weights_external", w["alice"], {**body, "age_encryption_recipients": ["age1xyz"]})
    assert r.status_code == 400 and "age_encryption_recipients" in r.json()["error"]
    r = post(c, "save_weights_external", w["alice"], body)
    assert r.status_code == 200 and r.json()["model_id"] == w["mid"]


# -- sessions: search, project, trace --------------------------------------------------------------
def test_session_search_pages_newest_first_over_the_callers_own_sessions(two):
    w, c = two, two["client"]
    extra = [post(c, "create_session", w["alice"], {"tags": [], "user_metadata": {"exp": str(i)}}).json()["session_id"]
             for i in range(3)]
    c.post(f"/api/v1/sessions/{extra[0]}/finish", headers=h(w["alice"]), json={"reason": {"type": "errored"}})
    mine = [w["sid"], *extra][::-1]  # newest first
    seen, cursor = [], None
    while True:
        r = post(c, "sessions/search", w["alice"], {"limit": 1, **({"cursor": cursor} if cursor else {})})
        assert r.status_code == 200, r.text
        page = r.json()
        seen += [x["session_id"] for x in page["sessions"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == mine and w["bob_sid"] not in seen
    one = post(c, "sessions/search", w["alice"], {"user_metadata": {"exp": "1"}}).json()["sessions"]
    assert [x["session_id"] for x in one] == [extra[1]] and one[0]["owner"] == "alice"
    errored = post(c, "sessions/search", w["alice"], {"statuses": [{"type": "client_finished",
                                                                    "reasons": ["errored"]}]}).json()["sessions"]
    assert [x["session_id"] for x in errored] == [extra[0]]
    assert post(c, "sessions/search", w["bob"], {"session_id": w["sid"]}).json()["sessions"] == []
    r = post(c, "sessions/search", w["alice"], {"limit": 201})
    assert r.status_code == 400 and "limit" in r.json()["error"]


def test_project_is_set_by_the_owner_and_searchable(two):
    w, c = two, two["client"]
    project = f"/api/v1/sessions/{w['sid']}/project"
    assert c.put(project, headers=h(w["bob"]), json={"project_id": "p"}).status_code == 404
    r = c.put(project, headers=h(w["alice"]), json={"project_id": "x" * 129})
    assert r.status_code == 400 and "project_id" in r.json()["error"]
    assert c.put(project, headers=h(w["alice"]), json={"project_id": "p"}).status_code == 200
    found = post(c, "sessions/search", w["alice"], {"project_ids": ["p"]}).json()["sessions"]
    assert [(x["session_id"], x["project_id"], x["checkpoints_count"]) for x in found] == [(w["sid"], "p", 1)]
    usage = c.get("/api/v1/billing/usage/checkpoints/current", headers=h(w["alice"]), params={"project_id": "p"})
    assert [x["checkpoint_count"] for x in usage.json()["data"]] == [1]
    assert post(c, "sessions/search", w["bob"], {"project_ids": ["p"]}).json()["sessions"] == []


def test_trace_export_is_the_owners_and_its_url_renders_the_session(two):
    w, c = two, two["client"]
    assert c.get(f"/api/v1/sessions/{w['sid']}/trace_export", headers=h(w["bob"])).status_code == 404
    r = c.get(f"/api/v1/sessions/{w['sid']}/trace_export", headers=h(w["alice"])).json()
    assert r["status"] == "ready"
    trace = _get(c, r["url"]).json()
    names = {e["name"] for e in trace["traceEvents"] if e.get("ph") == "X"}
    assert "queued create_model" in names  # new_model's request, still queued (no worker here)


# -- the SDK and the cookbook, end to end ----------------------------------------------------------
@pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning", "ignore::UserWarning")
def test_the_sdk_and_the_cookbook_drive_the_new_routes(tmp_path, builtin_dir, monkeypatch):
    """save_weights_external -> the cookbook's weights.download through the signed URLs; publish,
    a second tenant sampling from the published path; TTL, copy, project, search, trace, usage, all
    through the SDK's own calls (so its parsing of each answer is checked too)."""
    import urllib.request

    import tinker
    from safetensors.numpy import load_file
    from tinker import types
    from tinker_cookbook import weights

    from lockstep.service.tenants import create_tenant
    from service_fuzzing import in_process_service

    with in_process_service(tmp_path, {"lockstep/tiny": builtin_dir}) as (url, sessions):
        with sessions() as s:
            alice, bob = create_tenant(s, "alice")[1], create_tenant(s, "bob")[1]
        sc = tinker.ServiceClient(base_url=url, api_key=alice)
        tc = sc.create_lora_training_client(base_model="lockstep/tiny", rank=4, seed=0).result(timeout=300)
        state = tc.save_state("s1").result(timeout=300).path
        ex = tc.save_weights_external("ex").result(timeout=300).path
        assert ex.split("/")[-2:] == ["external_weights", "ex"]
        monkeypatch.setenv("TINKER_API_KEY", alice)
        out = weights.download(tinker_path=ex, output_dir=str(tmp_path / "dl"), base_url=url)
        tensors = [t for f in (tmp_path / "dl").glob("*.safetensors") for t in load_file(f).values()]
        assert tensors and all(t.size for t in tensors), list((tmp_path / "dl").iterdir())
        assert out == str(tmp_path / "dl")

        rc = sc.create_rest_client()
        rc.publish_checkpoint_from_tinker_path(state).result()
        bob_sampler = tinker.ServiceClient(base_url=url, api_key=bob).create_sampling_client(model_path=state)
        got = bob_sampler.sample(types.ModelInput.from_ints([5, 6]), 1,
                                 types.SamplingParams(max_tokens=2, temperature=0.0)).result(timeout=300)
        assert len(got.sequences[0].tokens) == 2
        rc.unpublish_checkpoint_from_tinker_path(state).result()
        rc.set_checkpoint_ttl_from_tinker_path(state, 7200).result()
        copy = rc.copy_weights(state, "archive").result()
        assert rc.get_weights_info_by_tinker_path(copy).result().lora_rank == 4
        [sid] = [x for x in rc.list_sessions().result().sessions
                 if x != copy.split("/")[2].split(":")[0]]
        rc.assign_session_project(sid, "lab").result()
        found = rc.search_sessions(types.SessionSearchRequest(project_ids=["lab"])).result()
        assert [x.session_id for x in found.sessions] == [sid] and found.sessions[0].checkpoints_count == 2
        trace = json_of(urllib.request.urlopen(rc.export_session_trace(sid).result()).read())
        assert {"save_weights", "save_weights_external"} <= {e["name"] for e in trace["traceEvents"]}
        usage = tinker.AdminClient(base_url=url, api_key=alice).get_current_checkpoint_storage_usage().result()
        assert sum(x.checkpoint_count for x in usage.data) == 3  # state, its copy, the export


def json_of(raw: bytes):
    import json

    return json.loads(raw)


def test_on_s3_each_url_is_the_buckets_presigned_get(tmp_path, builtin_dir, s3, monkeypatch):
    import requests
    from fastapi.testclient import TestClient

    from lockstep.service.app import ServiceConfig, create_app
    from lockstep.service.db import connect
    from lockstep.service.tenants import create_tenant
    from lockstep.service.worker import register_base_models

    env, _ = s3
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    cfg = ServiceConfig(db_url=f"sqlite:///{tmp_path / 'db.sqlite'}", storage_url="s3://lockstep-test/urls")
    _, sessions = connect(cfg.db_url)
    with sessions() as s:
        register_base_models(s, {"lockstep/tiny": builtin_dir})
        alice, bob = create_tenant(s, "alice")[1], create_tenant(s, "bob")[1]
    with TestClient(create_app(cfg)) as c:
        _, mid = new_model(c, alice)
        add_checkpoint(c, sessions, alice, mid, "external_weights", "ex", {"a.safetensors": b"S3" * 50}, tmp=tmp_path)
        cid = "/api/v1/training_runs/{}/checkpoints/external_weights/ex/external_weights_urls".format(mid)
        assert c.get(cid, headers=h(bob)).status_code == 404
        answer = c.get(cid, headers=h(alice)).json()
    url = answer["urls"]["a.safetensors"]
    query = parse_qs(urlsplit(url).query)
    assert url.startswith(env["AWS_ENDPOINT_URL"]) and "Signature" in query  # s3fs signs query-string (SigV2) URLs
    expires = int(query["Expires"][0])
    assert expires == int(dt.datetime.fromisoformat(answer["expires"]).timestamp())
    assert requests.get(url, timeout=30).content == b"S3" * 50
    # S3 itself refuses an altered or expired presigned URL; moto checks neither, so that is not tested here.
