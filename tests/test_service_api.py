"""The API process alone (no worker): torch-free, and bad input is a 4xx that changes nothing."""

import contextlib
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
from test_service_backends import postgres_url  # noqa: F401 - a fixture


@contextlib.contextmanager
def serving(tmp_path, builtin_dir, **limits):
    """The API in-process on a fresh SQLite store, with tenants alice and bob: (client, sessions, keys)."""
    cfg = ServiceConfig(db_url=f"sqlite:///{tmp_path / 'db.sqlite'}", storage_url=str(tmp_path / "storage"),
                        max_body_bytes=1 << 20, poll_timeout_s=0.2, **limits)
    _, sessions = connect(cfg.db_url)
    with sessions() as s:
        register_base_models(s, {"lockstep/tiny": builtin_dir})
        _, key_a = create_tenant(s, "alice")
        _, key_b = create_tenant(s, "bob")
    with TestClient(create_app(cfg)) as client:
        yield client, sessions, key_a, key_b


@pytest.fixture()
def api(tmp_path, builtin_dir):
    with serving(tmp_path, builtin_dir) as served:
        yield served


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
    from lockstep.config.types import LOSS_CORRECTION_KEYS
    from lockstep.losses import LOSS_CONFIG_KEYS
    from lockstep.losses.corrections import CORRECTION_KEYS
    from lockstep.service.types import SUPPORTED_LOSSES

    assert {k: tuple(v) for k, v in LOSS_CONFIG_KEYS.items()} == SUPPORTED_LOSSES
    assert set(CORRECTION_KEYS) == set(LOSS_CORRECTION_KEYS)


def test_bootstrap_and_auth(api):
    client, _, key, _ = api
    assert post(client, "client/config", key, {"sdk_version": "0.38.0"}).json()["pjwt_auth_enabled"] is False
    assert post(client, "client/config", "tml-wrong", {}).status_code == 401
    assert client.post("/api/v1/client/config", json={}).status_code == 401
    caps = client.get("/api/v1/get_server_capabilities", headers={"X-API-Key": key}).json()
    assert caps["supported_models"][0]["model_name"] == "lockstep/tiny"


SETTLED = {"wrong_dtype", "wrong_shape", "out_of_vocab", "path_name", "stable_reinforce", "bad_config_key"}
"""Refused after the model and seq_id were read: the refusal settles the seq_id."""


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
    ("topk_over_vocab", 400, "topk_prompt_logprobs=100000 exceeds the model's vocabulary"),
    ("alt_over_cells", 400, "prompt_alt_tokens_k asks for 2,000,000 logprobs"),
    ("target_wrong_rows", 400, "must have shape [len(prompt) - 1 = 1, K >= 1]"),
])
def test_bad_input_is_a_clear_4xx_and_queues_nothing(api, case, status, match):
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
                "tokens": [5, 10**6] if case == "bad_sample_tokens" else [5, 6]}]}, "sampling_params": {"max_tokens": 4}}
        body.update({"topk_over_vocab": {"topk_prompt_logprobs": 10**5}, "alt_over_cells": {"prompt_alt_tokens_k": 2 * 10**6},
                     "target_wrong_rows": {"target_prompt_logprobs": {"data": [5, 6], "dtype": "int64", "shape": [2, 1]}},
                     }.get(case, {}))
        r = post(client, "asample", key, body)
    assert r.status_code == status, r.text
    assert match in r.json()["error"] and r.json()["category"] == "user"
    if case not in SETTLED:
        assert counts(sessions) == before  # nothing was queued or created
        return
    # Refused once its model and seq_id were known: stored as already failed (with the answer's
    # error), so the model's later requests do not wait for seq 1; nothing was queued.
    assert counts(sessions) == (before[0] + 1, before[1])
    with sessions() as s:
        row = s.scalar(select(Request).where(Request.model_id == mid, Request.seq_id == 1))
        assert (row.state, row.error, row.error_category) == ("failed", r.json()["error"], "user")


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


def raw_fwdbwd(model_id, seq_id=1, *, tokens=b"\x05\0\0\0\x06\0\0\0\x07\0\0\0", target=None):
    """A ForwardBackwardRequest built field by field, so that its bytes can be wrong on purpose;
    `target(t)` edits the target_tokens TensorData."""
    msg = wire.pb2().ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    d = msg.data.add()
    d.model_input.add().encoded_text.tokens = tokens
    t = d.loss_fn_inputs["target_tokens"]
    t.dtype, t.dense = 2, np.asarray([6, 7, 8], np.int64).tobytes()
    t.shape.extend([3])
    if target is not None:
        target(t)
    return msg.SerializeToString()


def _shape(*dims, sparse=None, dense=None):
    def edit(t):
        del t.shape[:]
        t.shape.extend(dims)
        if dense is not None:
            t.dense = dense
        if sparse is not None:
            t.sparse_csr.values, t.sparse_csr.crow_indices, t.sparse_csr.col_indices = sparse
    return edit


def _nested(depth):
    value = {}
    for _ in range(depth):
        value = {"a": value}
    return value


BIG = [2**63, 10**30]
HOSTILE = {  # every 5xx the fuzzing of issue 14 found, and the bounds around them: (method, path, body)
    **{f"offset_{p}": ("get", f"{p}?offset={2**63}", None) for p in ("training_runs", "checkpoints", "sessions")},
    **{f"limit_{p}": ("get", f"{p}?limit={10**30}", None) for p in ("training_runs", "checkpoints", "sessions")},
    **{f"seq_{p}_{n}": ("post", p, {"model_id": "MID", "seq_id": n, "path": "ok"})
       for p in ("optim_step", "save_weights", "save_weights_for_sampler") for n in BIG},
    "ttl_seconds": ("post", "save_weights", {"model_id": "MID", "seq_id": 1, "path": "ok", "ttl_seconds": 10**12}),
    "model_seq_id": ("post", "create_model", {"session_id": "SID", "model_seq_id": 2**63,
                                              "base_model": "lockstep/tiny"}),
    **{f"lora_seed_{n}": ("post", "create_model", {"session_id": "SID", "model_seq_id": 5,
                                                  "base_model": "lockstep/tiny", "lora_config": {"rank": 4, "seed": n}})
       for n in (2**64, -2**64)},
    "lora_rank": ("post", "create_model", {"session_id": "SID", "model_seq_id": 5, "base_model": "lockstep/tiny",
                                           "lora_config": {"rank": 10**30}}),
    "token_bytes": ("proto", None, dict(tokens=b"\x05\0\0\0\x06\0")),
    "negative_shape": ("proto", None, dict(target=_shape(-1, -3))),
    "wrapping_shape": ("proto", None, dict(target=_shape(2**32, 2**32, dense=b""))),  # 2^64 wraps to 0 values
    "sparse_negative": ("proto", None, dict(target=_shape(-1, 5, sparse=(b"", b"", b"")))),
    "sparse_huge": ("proto", None, dict(target=_shape(1, 2**40, sparse=(b"", np.zeros(2, np.int64).tobytes(), b"")))),
    "deep_metadata": ("post", "create_session", {"user_metadata": _nested(300)}),
    "nan_metadata": ("raw", "create_session", b'{"user_metadata": {"x": NaN}}'),
    "surrogate": ("raw", "create_session", b'{"sdk_version": "\\ud800"}'),
    "nul_session": ("post", "session_heartbeat", {"session_id": "a\u0000b"}),
    "long_session": ("get", "sessions/" + "a" * 100, None),
    "huge_max_tokens": ("post", "asample", {"sampling_session_id": "SS", "prompt": {"chunks": [{"tokens": [5]}]},
                                            "sampling_params": {"max_tokens": 10**30}}),
    "num_samples_x_max_tokens": ("post", "asample", {"sampling_session_id": "SS", "num_samples": 256,
                                                     "prompt": {"chunks": [{"tokens": [5]}]},
                                                     "sampling_params": {"max_tokens": 300}}),
    "sample_seed": ("post", "asample", {"sampling_session_id": "SS", "prompt": {"chunks": [{"tokens": [5]}]},
                                        "sampling_params": {"max_tokens": 4, "seed": 2**70}}),
    "request_id": ("post", "retrieve_future", {"request_id": "r" * 10_000}),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_out_of_range_values_are_a_4xx_never_a_5xx(api, case):
    client, sessions, key, _ = api
    sid, mid = new_model(client, key)
    ss = post(client, "create_sampling_session", key, {"session_id": sid, "sampling_session_seq_id": 0,
                                                       "base_model": "lockstep/tiny"}).json()["sampling_session_id"]
    method, path, body = HOSTILE[case]
    headers = {"X-API-Key": key}
    if method == "proto":
        r = client.post("/api/v1/forward_backward", content=raw_fwdbwd(mid, **body),
                        headers={**headers, "Content-Type": "application/x-protobuf"})
    elif method == "raw":
        r = client.post(f"/api/v1/{path}", content=body, headers={**headers, "Content-Type": "application/json"})
    elif method == "get":
        r = client.get(f"/api/v1/{path}", headers=headers)
    else:
        text = json.dumps(body).replace('"MID"', json.dumps(mid)).replace('"SID"', json.dumps(sid))
        r = client.post(f"/api/v1/{path}", content=text.replace('"SS"', json.dumps(ss)),
                        headers={**headers, "Content-Type": "application/json"})
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    assert r.json()["category"] == "user" and len(r.text) < 2000, r.text
    listed = client.get("/api/v1/sessions", headers=headers).json()["sessions"]
    assert all(client.get(f"/api/v1/sessions/{x}", headers=headers).status_code == 200 for x in listed)


@pytest.mark.parametrize("path, content_type", [("create_session", "application/json"),
                                                 ("forward_backward", "application/x-protobuf")])
def test_a_body_without_content_length_is_held_to_the_limit(api, path, content_type):
    client, _, key, _ = api

    def chunks():  # a chunked body: no Content-Length to refuse it by
        for _ in range(40):
            yield b"\0" * (1 << 20)

    r = client.post(f"/api/v1/{path}", content=chunks(), headers={"X-API-Key": key, "Content-Type": content_type})
    assert r.status_code == 413 and "exceeds" in r.json()["error"], r.text


def test_a_datum_must_fit_the_model_context_and_a_request_the_token_cap(tmp_path, builtin_dir):
    with serving(tmp_path, builtin_dir, max_tokens_per_request=1000) as (client, _, key, _):
        _, mid = new_model(client, key)
        proto = {"headers": {"X-API-Key": key, "Content-Type": "application/x-protobuf"}}
        r = client.post("/api/v1/forward_backward", content=fwdbwd(mid, tokens=(5,) * 600), **proto)
        assert r.status_code == 400 and "do not fit the model's context of 512" in r.json()["error"], r.text
        tokens = tuple(5 + i % 50 for i in range(500))
        many = wire.pb2().ForwardBackwardRequest.FromString(fwdbwd(mid, 2, tokens=tokens))
        many.data.add().CopyFrom(many.data[0])  # 2 x 500 tokens: the cap
        assert client.post("/api/v1/forward_backward", content=many.SerializeToString(), **proto).status_code == 200
        many.seq_id = 3
        many.data[1].model_input[0].encoded_text.tokens += np.int32(5).tobytes()  # one more
        many.data[1].loss_fn_inputs["target_tokens"].dense += np.int64(5).tobytes()
        many.data[1].loss_fn_inputs["weights"].dense += np.float32(1).tobytes()
        r = client.post("/api/v1/forward_backward", content=many.SerializeToString(), **proto)
        assert r.status_code == 400 and "1001 tokens; at most 1000 per request" in r.json()["error"], r.text
        cfg = post(client, "client/config", key, {}).json()
        # what the SDK chunks its batches under
        assert (cfg["fwdbwd_max_chunk_bytes_count"], cfg["fwdbwd_max_chunk_len"]) == (8000, 1024)


def test_refused_training_requests_settle_their_seq_ids_in_order(api):
    """A request refused once its model and seq_id are known is stored as failed; the model's order
    passes over it when its turn comes (not before), so nothing after it waits forever."""
    from lockstep.service import queue

    client, sessions, key, _ = api
    _, mid = new_model(client, key)
    proto = {"headers": {"X-API-Key": key, "Content-Type": "application/x-protobuf"}}
    ok = lambda r: r.status_code == 200  # noqa: E731
    assert ok(client.post("/api/v1/forward_backward", content=fwdbwd(mid, 1), **proto))
    bad_token = client.post("/api/v1/forward_backward", content=fwdbwd(mid, 2, tokens=(5, 10**6, 7)), **proto)
    bad_adam = post(client, "optim_step", key, {"model_id": mid, "seq_id": 3, "adam_params": {"beta1": 2}})
    assert ok(post(client, "optim_step", key, {"model_id": mid, "seq_id": 4}))
    bad_name = post(client, "save_weights", key, {"model_id": mid, "seq_id": 6, "path": "../x"})
    assert ok(client.post("/api/v1/forward_backward", content=fwdbwd(mid, 5), **proto))  # after seq 6 arrived
    assert [r.status_code for r in (bad_token, bad_adam, bad_name)] == [400, 400, 400]
    assert "beta1" in bad_adam.json()["error"]
    before = counts(sessions)
    again = client.post("/api/v1/forward_backward", content=fwdbwd(mid, 2, tokens=(5, 10**6, 7)), **proto)
    assert (again.status_code, again.json()) == (400, bad_token.json())  # a retry: the same answer
    assert client.post("/api/v1/forward_backward", content=fwdbwd(mid, 2), **proto).status_code == 409
    assert counts(sessions) == before

    def done_seq():
        with sessions() as s:
            return s.get(Model, mid).done_seq

    ran = []
    while True:
        with sessions() as s:
            req = queue.claim_next(s, "w")
            if req is None:
                break
            ran.append(req.seq_id)
            assert done_seq() == req.seq_id - 1  # at seq 1's claim: 0 (2 and 3 are passed after 1, not before)
            queue.finish(s, req.id, "w", result=b"{}")
    assert ran == [0, 1, 4, 5] and done_seq() == 6
    late = post(client, "optim_step", key, {"model_id": mid, "seq_id": 7, "adam_params": {"eps": -1}})
    assert late.status_code == 400 and done_seq() == 7  # its turn had come: passed at once


@pytest.mark.parametrize("store", ["sqlite", "postgres"])
def test_concurrent_model_creation_stops_at_the_quota(tmp_path, builtin_dir, store, request):
    """16 creations at once against a quota of 3: exactly 3 models (counting and then inserting
    without a lock let several creations see the same count and all insert)."""
    import threading


    url = request.getfixturevalue("postgres_url") if store == "postgres" else f"sqlite:///{tmp_path / 'db.sqlite'}"
    cfg = ServiceConfig(db_url=url, storage_url=str(tmp_path / "storage"))
    _, sessions = connect(url)
    name = f"quota-{tmp_path.name}"[:64]
    with sessions() as s:
        register_base_models(s, {"lockstep/tiny": builtin_dir})
        tenant, key = create_tenant(s, name, max_models=3)
    with TestClient(create_app(cfg)) as client:
        sid = post(client, "create_session", key, {}).json()["session_id"]
        start, codes = threading.Barrier(16), []

        def create(i):
            start.wait()
            codes.append(post(client, "create_model", key, {"session_id": sid, "model_seq_id": i,
                                                            "base_model": "lockstep/tiny"}).status_code)

        threads = [threading.Thread(target=create, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    with sessions() as s:
        made = s.scalar(select(func.count()).select_from(Model).where(Model.tenant_id == tenant.id))
    assert sorted(codes) == [200] * 3 + [429] * 13 and made == 3, (codes, made)


def test_a_trailing_newline_does_not_pass_for_a_name(tmp_path):
    """`$` matches before a final newline: 'ck\\n' passed as a checkpoint name (a storage key)."""
    from lockstep.service.types import ServiceError

    for name in ("ck\n", "ck\n\n", "ck/..", "..", "../ck", ""):
        with pytest.raises(ServiceError, match="use 1-128 letters"):
            wire.check_name(name, "checkpoint name")
    assert wire.check_name("ck.v1:final-2", "checkpoint name") == "ck.v1:final-2"
    _, sessions = connect(f"sqlite:///{tmp_path / 'db.sqlite'}")
    with sessions() as s, pytest.raises(ServiceError, match="tenant name"):
        create_tenant(s, "carol\n")


@pytest.mark.parametrize("store", ["sqlite", "postgres"])
def test_ids_no_object_can_have_are_a_404_on_every_store(tmp_path, builtin_dir, store, request):
    """PostgreSQL refuses NUL in a text parameter (SQLite does not): such an id must not reach a query."""
    url = request.getfixturevalue("postgres_url") if store == "postgres" else f"sqlite:///{tmp_path / 'db.sqlite'}"
    _, sessions = connect(url)
    with sessions() as s:
        register_base_models(s, {"lockstep/tiny": builtin_dir})
        _, key = create_tenant(s, f"nul-{tmp_path.name}"[:64])
    cfg = ServiceConfig(db_url=url, storage_url=str(tmp_path / "storage"))
    with TestClient(create_app(cfg)) as client:
        headers = {"X-API-Key": key}
        for model_id in ("a\x00b", "a\x7f", "m" * 10_000):
            r = client.post("/api/v1/forward_backward", content=fwdbwd(model_id),
                            headers={**headers, "Content-Type": "application/x-protobuf"})
            assert r.status_code == 404, r.text
        for path in ("sessions/a%00b", "samplers/a%00b", "training_runs/a%00b", "training_runs/a%00b/checkpoints"):
            assert 400 <= client.get(f"/api/v1/{path}", headers=headers).status_code < 500, path
        r = client.post("/api/v1/retrieve_future", headers=headers, json={"request_id": "a\x00b"})
        assert r.status_code == 400, r.text
        for path in ("/v1/jobs?state=%00", "/v1/jobs/a%00b", "/v1/jobs/a%1fb/events?follow=false",
                     "/api/v1/training_runs?limit=1%00"):
            assert client.get(path, headers=headers).status_code == 400, path  # refused before any route
        assert client.post("/v1/jobs/a%00b/cancel", headers=headers).status_code == 400
        for name in ("a\x00b", "line\nbreak"):  # a job's name is stored: NUL was a 500 on PostgreSQL
            r = client.post("/v1/jobs", headers=headers, json={"spec": {}, "name": name})
            assert r.status_code == 400 and "name: String should match" in r.text, r.text


def test_stop_strings_and_tags_may_hold_any_text(api):
    """Only ids, names and what is looked up are held to printable characters: a newline is a
    common stop string (tinker-cookbook's arithmetic env stops at one)."""
    client, _, key, _ = api
    sid = post(client, "create_session", key, {"tags": ["line\none", "tab\there"]}).json()["session_id"]
    ss = post(client, "create_sampling_session", key, {"session_id": sid, "sampling_session_seq_id": 0,
                                                       "base_model": "lockstep/tiny"}).json()["sampling_session_id"]
    for stop in ("\n", ["\n\n", "Q:"]):
        r = post(client, "asample", key, {"sampling_session_id": ss, "prompt": {"chunks": [{"tokens": [5, 6]}]},
                                          "sampling_params": {"max_tokens": 4, "stop": stop}})
        assert r.status_code == 200, r.text


def test_an_expired_checkpoint_is_gone_before_the_janitor_and_a_delete_keeps_weights_in_use(api, tmp_path):
    """Past its expires_at a checkpoint is a 404 everywhere at once (the janitor, which deletes it,
    runs only every --janitor-every s; here there is no worker at all). Deleting a checkpoint removes
    its row, then its storage unless a sampling session still samples from those weights."""
    import datetime as dt

    from lockstep.service.db import Checkpoint, SamplingSession, Tenant, now

    client, sessions, key_a, _ = api
    sid, model_id = new_model(client, key_a)
    storage = tmp_path / "storage"
    with sessions() as s:
        alice = s.scalar(select(Tenant).where(Tenant.name == "alice"))
        for name, expires in (("old", now() - dt.timedelta(seconds=1)), ("live", now() + dt.timedelta(hours=1)),
                              ("pinned", None)):
            (storage / f"ck/{name}").mkdir(parents=True)
            (storage / f"ck/{name}/MANIFEST.json").write_text("{}")
            s.add(Checkpoint(tenant_id=alice.id, model_id=model_id, kind="sampler_weights", name=name,
                             storage_path=f"ck/{name}", expires_at=expires))
        s.add(SamplingSession(id=f"{model_id}:pinned", tenant_id=alice.id, session_id=sid, base_model="lockstep/tiny",
                              model_path=f"tinker://{model_id}/sampler_weights/pinned", weights_path="ck/pinned",
                              vocab_size=64))
        s.commit()
    listed = client.get(f"/api/v1/training_runs/{model_id}/checkpoints", headers={"X-API-Key": key_a}).json()
    assert sorted(c["checkpoint_id"] for c in listed["checkpoints"]) == ["sampler_weights/live", "sampler_weights/pinned"]
    mine = client.get("/api/v1/checkpoints", headers={"X-API-Key": key_a}).json()
    assert mine["cursor"]["total_count"] == 2
    old = f"tinker://{model_id}/sampler_weights/old"
    assert post(client, "weights_info", key_a, {"tinker_path": old}).status_code == 404
    r = post(client, "create_sampling_session", key_a, {"session_id": sid, "sampling_session_seq_id": 0,
                                                        "model_path": old})
    assert r.status_code == 404 and "no checkpoint" in r.text
    assert client.delete(f"/api/v1/training_runs/{model_id}/checkpoints/sampler_weights/old",
                         headers={"X-API-Key": key_a}).status_code == 404
    for name in ("live", "pinned"):
        r = client.delete(f"/api/v1/training_runs/{model_id}/checkpoints/sampler_weights/{name}",
                          headers={"X-API-Key": key_a})
        assert r.status_code == 200, r.text
    assert not (storage / "ck/live").exists()  # nothing else used it
    assert (storage / "ck/pinned/MANIFEST.json").is_file()  # a sampling session still samples from it
    with sessions() as s:
        assert s.scalar(select(func.count()).select_from(Checkpoint)) == 1  # only the expired row, the janitor's
