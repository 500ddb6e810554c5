"""The API process alone (no worker): torch-free, and bad input is a 4xx that changes nothing."""

import json
import subprocess
import sys

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from lockstep.service import wire
from lockstep.service.app import ServiceConfig, create_app
from lockstep.service.db import Model, Request, connect
from lockstep.service.tenants import create_tenant
from lockstep.service.worker import register_base_models


@pytest.fixture()
def api(tmp_path, builtin_dir):
    cfg = ServiceConfig(db_url=f"sqlite:///{tmp_path / 'db.sqlite'}", storage_url=str(tmp_path / "storage"),
                        max_body_bytes=1 << 20, poll_timeout_s=0.2)
    _, sessions = connect(cfg.db_url)
    with sessions() as s:
        register_base_models(s, {"lockstep/tiny": builtin_dir})
        _, key_a = create_tenant(s, "alice")
        _, key_b = create_tenant(s, "bob")
    with TestClient(create_app(cfg)) as client:
        yield client, sessions, key_a, key_b


def post(client, path, key, body=None, **kw):
    return client.post(f"/api/v1/{path}", headers={"X-API-Key": key}, json=body, **kw)


def new_model(client, key, rank=4):
    sid = post(client, "create_session", key, {"tags": [], "sdk_version": "0.38.0"}).json()["session_id"]
    r = post(client, "create_model", key, {"session_id": sid, "model_seq_id": 0, "base_model": "lockstep/tiny",
                                           "lora_config": {"rank": rank}})
    assert r.status_code == 200, r.text
    return sid, r.json()["model_id"]


def fwdbwd(model_id, seq_id=1, *, tokens=(5, 6, 7), targets=None, weights=None, loss="cross_entropy", config=None):
    n = len(tokens)
    targets = targets if isinstance(targets, np.ndarray) else np.asarray(list(tokens[1:]) + [8], np.int64)
    inputs = {"target_tokens": targets,
              "weights": np.asarray(weights if weights is not None else [1.0] * n, np.float32)}
    fb = wire.FwdBwd(model_id, seq_id, (wire.WireDatum(tuple(tokens), inputs),), loss, config or {}, False)
    return wire.encode_forward_backward(fb)


def counts(sessions):
    with sessions() as s:
        return s.scalar(select(func.count()).select_from(Request)), s.scalar(select(func.count()).select_from(Model))


def test_the_api_never_imports_torch():
    code = ("import sys, lockstep.service.app, lockstep.service.tinker_api, lockstep.service.queue, "
            "lockstep.service.serve, lockstep.cli; assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_supported_losses_match_the_engine():
    from lockstep.losses import LOSS_CONFIG_KEYS
    from lockstep.losses.corrections import CORRECTION_KEYS
    from lockstep.service.types import CORRECTION_KEYS as SERVICE_CORRECTIONS
    from lockstep.service.types import SUPPORTED_LOSSES

    assert {k: tuple(v) for k, v in LOSS_CONFIG_KEYS.items()} == SUPPORTED_LOSSES
    assert set(CORRECTION_KEYS) == set(SERVICE_CORRECTIONS)


def test_bootstrap_and_auth(api):
    client, _, key, _ = api
    assert post(client, "client/config", key, {"sdk_version": "0.38.0"}).json()["pjwt_auth_enabled"] is False
    assert post(client, "client/config", "tml-wrong", {}).status_code == 401
    assert client.post("/api/v1/client/config", json={}).status_code == 401
    caps = client.get("/api/v1/get_server_capabilities", headers={"X-API-Key": key}).json()
    assert caps["supported_models"][0]["model_name"] == "lockstep/tiny"


@pytest.mark.parametrize("case, status, match", [
    ("malformed_json", 400, "invalid request"),
    ("malformed_proto", 400, "malformed protobuf"),
    ("oversized", 413, "exceeds"),
    ("unknown_model", 404, "unknown model_id"),
    ("wrong_dtype", 400, "target_tokens must be int64"),
    ("wrong_shape", 400, "has shape [2], expected [3]"),
    ("out_of_vocab", 400, "outside the vocabulary"),
    ("path_name", 400, "no '/'"),
    ("stable_reinforce", 400, "importance_sampling"),
    ("bad_config_key", 400, "does not take config keys"),
    ("other_tenant", 404, "unknown model_id"),
    ("bad_sample_tokens", 400, "outside the vocabulary"),
    ("unsupported_topk", 400, "topk_prompt_logprobs is not supported"),
])
def test_bad_input_is_a_clear_4xx_and_changes_nothing(api, case, status, match):
    client, sessions, key, other = api
    sid, mid = new_model(client, key)
    before = counts(sessions)
    proto = {"headers": {"X-API-Key": key, "Content-Type": "application/x-protobuf"}}
    if case == "malformed_json":
        r = client.post("/api/v1/optim_step", headers={"X-API-Key": key, "Content-Type": "application/json"},
                        content=b"{not json")
    elif case == "malformed_proto":
        r = client.post("/api/v1/forward_backward", content=b"\xff\xfe garbage", **proto)
    elif case == "oversized":
        r = client.post("/api/v1/forward_backward", content=b"\0" * (2 << 20), **proto)
    elif case == "unknown_model":
        r = client.post("/api/v1/forward_backward", content=fwdbwd("nope:train:0"), **proto)
    elif case == "wrong_dtype":
        r = client.post("/api/v1/forward_backward", content=fwdbwd(mid, targets=np.array([6.0, 7.0, 8.0], np.float32)),
                        **proto)
    elif case == "wrong_shape":
        r = client.post("/api/v1/forward_backward", content=fwdbwd(mid, weights=[1.0, 1.0]), **proto)
    elif case == "out_of_vocab":
        r = client.post("/api/v1/forward_backward", content=fwdbwd(mid, tokens=(5, 99999, 7)), **proto)
    elif case == "path_name":
        r = post(client, "save_weights", key, {"model_id": mid, "seq_id": 1, "path": "../../etc/passwd"})
    elif case == "stable_reinforce":
        r = client.post("/api/v1/forward_backward", content=fwdbwd(mid, loss="stable_reinforce"), **proto)
    elif case == "bad_config_key":
        r = client.post("/api/v1/forward_backward", content=fwdbwd(mid, loss="ppo", config={"clip": 0.1}), **proto)
    elif case == "other_tenant":
        r = client.post("/api/v1/forward_backward", content=fwdbwd(mid),
                        headers={"X-API-Key": other, "Content-Type": "application/x-protobuf"})
    else:
        ss = post(client, "create_sampling_session", key, {"session_id": sid, "sampling_session_seq_id": 0,
                                                           "base_model": "lockstep/tiny"}).json()["sampling_session_id"]
        before = counts(sessions)
        body = {"sampling_session_id": ss, "num_samples": 1, "prompt": {"chunks": [{"type": "encoded_text",
                "tokens": [5, 6] if case == "unsupported_topk" else [5, 10**6]}]}, "sampling_params": {"max_tokens": 4}}
        if case == "unsupported_topk":
            body["topk_prompt_logprobs"] = 3
        r = post(client, "asample", key, body)
    assert r.status_code == status, r.text
    assert match in r.json()["error"] and r.json()["category"] == "user"
    assert counts(sessions) == before  # nothing was queued or created


def test_retries_are_idempotent_and_conflicts_refused(api):
    client, sessions, key, _ = api
    _, mid = new_model(client, key)
    proto = {"headers": {"X-API-Key": key, "Content-Type": "application/x-protobuf"}}
    first = client.post("/api/v1/forward_backward", content=fwdbwd(mid), **proto).json()["request_id"]
    again = client.post("/api/v1/forward_backward", content=fwdbwd(mid), **proto).json()["request_id"]
    assert first == again
    other = client.post("/api/v1/forward_backward", content=fwdbwd(mid, tokens=(9, 9, 9)), **proto)
    assert other.status_code == 409
    pending = post(client, "retrieve_future", key, {"request_id": first}).json()
    assert pending["type"] == "try_again"  # no worker: it stays queued, the poll returns in time
    assert post(client, "retrieve_future", key, {"request_id": "nope"}).status_code == 404
    r = client.post("/api/v1/forward_backward", content=fwdbwd(mid),
                    headers={"X-API-Key": api[3], "Content-Type": "application/x-protobuf"})
    assert r.status_code == 404  # bob cannot even see alice's model


def test_tenants_cli_prints_the_key_once_as_json(tmp_path):
    db = f"sqlite:///{tmp_path / 'db.sqlite'}"
    out = subprocess.run([sys.executable, "-m", "lockstep.cli", "tenants", "create", "carol", "--db", db, "--json"],
                         check=True, capture_output=True, text=True).stdout
    last = json.loads(out.strip().splitlines()[-1])
    assert last["tenant"] == "carol" and last["api_key"].startswith("tml-")
    _, sessions = connect(db)
    from lockstep.service.db import Tenant
    from lockstep.service.tenants import hash_key

    with sessions() as s:
        row = s.scalar(select(Tenant).where(Tenant.name == "carol"))
        assert row.key_hash == hash_key(last["api_key"]) and last["api_key"] not in json.dumps(row.__dict__, default=str)
    dup = subprocess.run([sys.executable, "-m", "lockstep.cli", "tenants", "create", "carol", "--db", db],
                         capture_output=True, text=True)
    assert dup.returncode == 2 and "already exists" in dup.stderr


def test_model_quota_is_a_429_that_creates_nothing(api):
    client, sessions, key, _ = api
    from lockstep.service.db import Tenant

    sid, _ = new_model(client, key)  # the key is now in the API's auth cache, with the old quota
    with sessions() as s:
        s.scalar(select(Tenant).where(Tenant.name == "alice")).max_models = 2
        s.commit()
    post(client, "create_model", key, {"session_id": sid, "model_seq_id": 1, "base_model": "lockstep/tiny"})
    before = counts(sessions)
    r = post(client, "create_model", key, {"session_id": sid, "model_seq_id": 2, "base_model": "lockstep/tiny"})
    assert r.status_code == 429 and "quota 2" in r.json()["error"], r.text
    assert counts(sessions) == before
    retry = post(client, "create_model", key, {"session_id": sid, "model_seq_id": 1, "base_model": "lockstep/tiny"})
    assert retry.status_code == 200  # a retried creation of an existing model is not a new model


def test_training_requests_run_in_seq_order_whatever_order_they_arrive(api):
    """The SDK posts the first chunk of a batch last: seq 2 waits until seq 1 is done."""
    from lockstep.service import queue

    client, sessions, key, _ = api
    _, mid = new_model(client, key)
    proto = {"headers": {"X-API-Key": key, "Content-Type": "application/x-protobuf"}}
    for seq in (2, 1):
        assert client.post("/api/v1/forward_backward", content=fwdbwd(mid, seq), **proto).status_code == 200

    def runnable_seqs():
        with sessions() as s:
            return [r.seq_id for r in queue.runnable(s) if r.model_id == mid]

    for expected in (0, 1, 2):  # seq 0 is the model's creation
        assert runnable_seqs() == [expected]
        with sessions() as s:
            req = s.scalar(select(Request).where(Request.model_id == mid, Request.seq_id == expected))
            assert queue.claim(s, req, "w")
            assert queue.finish(s, req.id, "w", result=b"{}")
    assert runnable_seqs() == []
