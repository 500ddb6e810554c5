"""Fuzzing the service over HTTP: schemathesis over every operation of its OpenAPI schema, and
hypothesis-built protobuf ForwardBackwardRequest bodies with hostile shapes, dtypes, sizes and byte
lengths. Shared by tests/test_service_fuzz.py (CI, in-process server) and bench/service_fuzz.py
(a live `lockstep serve`).

Generated ids rarely name a real object, so a drawn share of them is replaced by ids of objects
that exist (tenant A's session, model, checkpoints, sampler, request), and the caller is drawn too
(A, B, a wrong key, none): the cases then reach past the 404s into the validation and the store. A
drawn share of all strings is replaced by hostile ones (HOSTILE_TEXT), which schemathesis alone
rarely sends.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import requests
import schemathesis
from helpers import free_port
from hypothesis import HealthCheck, Phase, given, reject, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from lockstep.service import wire
from lockstep.service.types import SUPPORTED_LOSSES

TIMEOUT_S = 15.0
"""A request that takes longer is a hang (in_process_service's long-poll holds a pending future 2 s;
against `lockstep serve`, whose long-poll holds 25 s, use a longer one)."""


@dataclass
class Objects:
    """Tenant A's real objects, for the fuzzer to aim at."""

    session_id: str
    model_id: str
    sampler_id: str
    request_id: str
    weights_path: str
    sampler_path: str
    vocab_size: int


@dataclass
class Tally:
    cases: int = 0
    statuses: collections.Counter = field(default_factory=collections.Counter)
    failures: list = field(default_factory=list)
    """(what was sent, what came back) for every 5xx or hang."""
    seconds: float = 0.0

    def record(self, sent, response: requests.Response | None, error: Exception | None = None) -> None:
        self.cases += 1
        if response is None:
            self.statuses[type(error).__name__] += 1
            self.failures.append((sent, repr(error)[:300]))
            return
        self.statuses[response.status_code] += 1
        if response.status_code >= 500:
            self.failures.append((sent, response.text[:300]))

    def summary(self) -> dict:
        return {"cases": self.cases, "statuses": {str(k): v for k, v in sorted(self.statuses.items(), key=str)},
                "5xx_or_hang": len(self.failures), "seconds": round(self.seconds, 1)}


def _pools(o: Objects) -> dict[str, list]:
    return {"session_id": [o.session_id], "model_id": [o.model_id], "run_id": [o.model_id],
            "sampling_session_id": [o.sampler_id], "sampler_id": [o.sampler_id], "request_id": [o.request_id],
            "path": [o.weights_path, o.sampler_path, "ck"], "model_path": [o.sampler_path, o.weights_path],
            "tinker_path": [o.weights_path, o.sampler_path], "checkpoint_id": ["weights/ck", "sampler_weights/s"],
            "seq_id": [1, 2, 3, 50], "base_model": ["lockstep/tiny"]}


def _aim(container, pools: dict, draw) -> None:
    """Replace a drawn share of the id-like fields of a dict with real ones, in place."""
    if not isinstance(container, dict):
        return
    for key in list(container):
        if key in pools and draw(st.booleans()):
            container[key] = draw(st.sampled_from(pools[key]))


HOSTILE_TEXT = ["\x00", "a\x00b", "\ud800", "\udfff", "../../../etc/passwd", "%2e%2e%2f%2e%2e", "/etc/passwd",
                "C:\\Windows", "tinker://../weights/x", "\u202egnp.", "\uff0e\uff0e", "\n", "\r\n", "", " ", "x" * 70_000,
                "\U0001f600", "\ufeff", "NaN", "-1", "9" * 40, "null", "{}", "'; DROP TABLE requests; --"]
"""Strings that broke services before: NUL (PostgreSQL refuses it in text), lone surrogates (the
store cannot encode them), traversal, huge, control characters, lookalikes."""


def _spoil(value, draw, depth: int = 0):
    """A drawn share of the strings in a generated value (and its nested dicts and lists) replaced
    by hostile ones; schemathesis alone rarely sends NUL or surrogates."""
    if isinstance(value, str):
        return draw(st.sampled_from(HOSTILE_TEXT)) if draw(st.integers(0, 7)) == 0 else value
    if depth > 4:
        return value
    if isinstance(value, dict):
        return {k: _spoil(v, draw, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [_spoil(v, draw, depth + 1) for v in value]
    return value


@dataclass
class Fuzzer:
    url: str
    keys: dict
    """"a" (the owner of `objects`) and "b" (another tenant)."""
    objects: Objects
    timeout_s: float = TIMEOUT_S
    tally: Tally = field(default_factory=Tally)
    http: requests.Session = field(default_factory=requests.Session)

    def _key(self, draw) -> dict:
        who = draw(st.sampled_from(["a", "a", "a", "b", "wrong", "none"]))
        key = self.keys.get(who, "tml-wrong" if who == "wrong" else None)
        return {"X-API-Key": key} if key else {}

    def schema_cases(self, n: int, *, fail_fast: bool) -> Tally:
        """n cases drawn from every operation of the OpenAPI schema, positive and negative."""
        # Revoking the calling key ends the fuzzing tenant's access for the rest of the run (its
        # refusals are tested in tests/test_tinker_routes.py).
        schema = schemathesis.openapi.from_url(f"{self.url}/openapi.json").exclude(
            method="DELETE", path="/api/v1/auth/apikey/me")
        cases = st.one_of(schema.as_strategy(GenerationMode.POSITIVE), schema.as_strategy(GenerationMode.NEGATIVE))
        pools = _pools(self.objects)

        @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck),
                  phases=[Phase.generate, Phase.shrink] if fail_fast else [Phase.generate])
        @given(case=cases, data=st.data())
        def one(case, data):
            for part in ("path_parameters", "query", "body"):
                value = getattr(case, part)
                if isinstance(value, dict):
                    value = _spoil(value, data.draw)
                    _aim(value, pools, data.draw)
                    setattr(case, part, value)
            headers = self._key(data.draw)
            sent = (case.method, case.formatted_path, case.query, str(case.body)[:300])
            try:
                self._send(sent, lambda: case.call(base_url=self.url, session=self.http, headers=headers,
                                                   timeout=self.timeout_s), fail_fast)
            except UnicodeEncodeError:  # a lone surrogate in the URL: no client can send it
                reject()

        self._timed(one)
        return self.tally

    def protobuf_cases(self, n: int, *, fail_fast: bool) -> Tally:
        """n hostile ForwardBackwardRequest bodies posted to /api/v1/forward_backward."""
        bodies = forward_backward_bodies(self.objects)

        @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck),
                  phases=[Phase.generate, Phase.shrink] if fail_fast else [Phase.generate])
        @given(body=bodies, data=st.data())
        def one(body, data):
            headers = {**self._key(data.draw), "Content-Type": "application/x-protobuf"}
            sent = ("POST", "/api/v1/forward_backward", None, body[:300])
            self._send(sent, lambda: self.http.post(f"{self.url}/api/v1/forward_backward", data=body, headers=headers,
                                                    timeout=self.timeout_s), fail_fast)

        self._timed(one)
        return self.tally

    def _send(self, sent: tuple, call, fail_fast: bool) -> None:
        """Make one request, record its answer (or the connection error) in the tally; with
        fail_fast, a 5xx or no answer fails the case (hypothesis then shrinks it)."""
        try:
            response, error = call(), None
        except requests.RequestException as e:
            response, error = None, e
        self.tally.record(sent, response, error)
        if fail_fast:
            assert response is not None and response.status_code < 500, (sent, error or response.text[:300])

    def _timed(self, run) -> None:
        start = time.perf_counter()
        try:
            run()
        finally:
            self.tally.seconds += time.perf_counter() - start


# -- protobuf bodies -----------------------------------------------------------------------------
_DIMS = st.one_of(st.integers(-3, 8), st.sampled_from([2**31, 2**32, 2**40, 2**62, -2**63, 2**63 - 1]))
_DTYPES = st.one_of(st.sampled_from([0, 1, 2, 3, 4]), st.integers(-2**31, 2**31 - 1))


@st.composite
def _tensor(draw, n: int, vocab: int):
    """A TensorData for a datum of n tokens: well-formed, or wrong in one or several ways."""
    t = wire.pb2().Tensor()
    dtype = draw(st.one_of(st.sampled_from([1, 2, 3]), _DTYPES))
    t.dtype = dtype
    itemsize = {1: 4, 2: 8, 3: 4}.get(dtype, 4)
    if draw(st.booleans()):
        t.shape.extend(draw(st.one_of(st.just([n]), st.lists(_DIMS, max_size=4))))
    if draw(st.integers(0, 4)) == 0:  # sparse CSR, with indices that may or may not fit
        t.sparse_csr.values = draw(st.binary(max_size=64))
        fitting = np.arange(2, dtype=np.int64).tobytes()
        t.sparse_csr.crow_indices = draw(st.one_of(st.binary(max_size=48), st.just(fitting)))
        t.sparse_csr.col_indices = draw(st.binary(max_size=48))
    elif draw(st.booleans()):  # the right size, values in or out of range
        values = draw(st.lists(st.integers(-1, vocab + 1), min_size=n, max_size=n))
        t.dense = np.asarray(values, {1: np.float32, 2: np.int64, 3: np.int32}.get(dtype, np.int64)).tobytes()
    else:
        t.dense = draw(st.binary(max_size=itemsize * (n + 2)))
    return t


@st.composite
def _datum(draw, vocab: int):
    p = wire.pb2()
    d = p.Datum()
    n = draw(st.integers(0, 12))
    for _ in range(draw(st.integers(0, 3))):
        chunk = d.model_input.add()
        kind = draw(st.sampled_from(["tokens", "tokens", "tokens", "bytes", "image", "dmel"]))
        if kind == "tokens":
            chunk.encoded_text.tokens = np.asarray(draw(st.lists(st.integers(-2, vocab + 2), min_size=n, max_size=n)),
                                                   np.int32).tobytes()
        elif kind == "bytes":
            chunk.encoded_text.tokens = draw(st.binary(max_size=4 * n + 3))
        elif kind == "image":
            chunk.image.data, chunk.image.format = draw(st.binary(max_size=16)), draw(st.text(max_size=8))
        else:
            chunk.dmel.dmel = draw(st.binary(max_size=16))
    keys = st.one_of(st.sampled_from(wire.KNOWN_KEYS), st.text(max_size=12))
    for key in draw(st.lists(keys, max_size=4, unique=True)):
        d.loss_fn_inputs[key].CopyFrom(draw(_tensor(n, vocab)))
    return d


@st.composite
def _request(draw, o: Objects):
    p = wire.pb2()
    msg = p.ForwardBackwardRequest()
    msg.model_id = draw(st.one_of(st.just(o.model_id), st.just(o.model_id), st.text(max_size=200)))
    msg.seq_id = draw(st.one_of(st.integers(-3, 60), st.integers(-2**31, 2**31 - 1)))
    msg.loss_fn = draw(st.one_of(st.sampled_from(sorted(SUPPORTED_LOSSES)), st.text(max_size=40)))
    for key in draw(st.lists(st.one_of(st.sampled_from(["clip_low_threshold", "beta", "tis_cap"]), st.text(max_size=8)),
                             max_size=3)):
        msg.loss_fn_config[key] = draw(st.floats(allow_nan=True, allow_infinity=True, width=32))
    if draw(st.booleans()):
        msg.loss_fn_config_v2["k"].text = draw(st.text(max_size=8))
    msg.forward_only = draw(st.booleans())
    for d in draw(st.lists(_datum(o.vocab_size), max_size=4)):
        msg.data.add().CopyFrom(d)
    return msg.SerializeToString()


def forward_backward_bodies(o: Objects):
    """Protobuf bodies: built message by message, then some cut short or made of random bytes."""
    whole = _request(o)
    cut = st.tuples(whole, st.integers(0, 400)).map(lambda bc: bc[0][: bc[1]])
    return st.one_of(whole, whole, whole, cut, st.binary(max_size=256))


# -- a service to fuzz ---------------------------------------------------------------------------
@contextlib.contextmanager
def in_process_service(home: Path, models: dict, db_url: str | None = None, **limits):
    """The API (uvicorn) and an Executor (the worker's claim loop and engine), each in a thread of
    this process, on one store (SQLite under `home` by default): (url, sessions). Real components,
    one process."""
    import uvicorn

    from lockstep.service.app import ServiceConfig, create_app
    from lockstep.service.db import connect
    from lockstep.service.executor import RequestExecutor
    from lockstep.service.types import WorkerConfig
    from lockstep.service.worker import register_base_models

    db, storage = db_url or f"sqlite:///{home / 'db.sqlite'}", str(home / "storage")
    _, sessions = connect(db)
    with sessions() as s:
        register_base_models(s, models)
    executor = RequestExecutor(WorkerConfig(db_url=db, storage_url=storage, home=str(home / "worker"), threads=1),
                               f"worker-{home.name}"[:64], os.getpid())
    serving = threading.Thread(target=executor.serve, daemon=True, name="executor")
    serving.start()
    port = free_port()
    cfg = ServiceConfig(db_url=db, storage_url=storage, poll_timeout_s=2.0, **limits)
    server = uvicorn.Server(uvicorn.Config(create_app(cfg), host="127.0.0.1", port=port, log_level="warning"))
    api = threading.Thread(target=server.run, daemon=True, name="api")
    api.start()
    while not server.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", sessions
    finally:
        server.should_exit = True
        executor.stop()
        api.join(10)
        serving.join(30)


def call(url: str, key: str, path: str, body: dict | bytes, *, wait: bool = True, timeout_s: float = 120) -> dict:
    """POST a Tinker call; with `wait`, long-poll its future until it is done (its result)."""
    headers = {"X-API-Key": key}
    if isinstance(body, bytes):
        r = requests.post(f"{url}/api/v1/{path}", data=body, timeout=30,
                          headers={**headers, "Content-Type": "application/x-protobuf"})
    else:
        r = requests.post(f"{url}/api/v1/{path}", json=body, headers=headers, timeout=30)
    r.raise_for_status()
    out = r.json()
    if not wait or "request_id" not in out:
        return out
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        res = requests.post(f"{url}/api/v1/retrieve_future", json={"request_id": out["request_id"]}, headers=headers,
                            timeout=30)
        if res.headers.get("content-type", "").startswith("application/x-protobuf"):
            return {**out, "result": res.content}
        got = res.json()
        if got.get("type") != "try_again":
            assert "error" not in got, got
            return {**out, **got}
    raise TimeoutError(f"{path} did not finish in {timeout_s} s")


def sft_body(model_id: str, seq_id: int, tokens=(5, 6, 7, 8)) -> bytes:
    inputs = {"target_tokens": np.asarray(list(tokens[1:]) + [9], np.int64),
              "weights": np.ones(len(tokens), np.float32)}
    fb = wire.FwdBwd(model_id, seq_id, (wire.WireDatum(tuple(tokens), inputs),), "cross_entropy", {}, False)
    return wire.encode_forward_backward(fb)


def make_objects(url: str, key: str) -> Objects:
    """A session, a trained LoRA model, a training and a sampler checkpoint and a sampling session."""
    sid = call(url, key, "create_session", {"tags": [], "sdk_version": "0.38.0"})["session_id"]
    mid = call(url, key, "create_model", {"session_id": sid, "model_seq_id": 0, "base_model": "lockstep/tiny",
                                          "lora_config": {"rank": 4, "seed": 0}})["model_id"]
    first = call(url, key, "forward_backward", sft_body(mid, 1))
    call(url, key, "optim_step", {"model_id": mid, "seq_id": 2, "adam_params": {"learning_rate": 1e-2}})
    weights = call(url, key, "save_weights", {"model_id": mid, "seq_id": 3, "path": "ck"})["path"]
    sampler = call(url, key, "save_weights_for_sampler", {"model_id": mid, "seq_id": 4, "path": "s"})["path"]
    ss = call(url, key, "create_sampling_session", {"session_id": sid, "sampling_session_seq_id": 0,
                                                    "model_path": sampler})["sampling_session_id"]
    return Objects(session_id=sid, model_id=mid, sampler_id=ss, request_id=first["request_id"],
                   weights_path=weights, sampler_path=sampler, vocab_size=_vocab(url, key, mid))


def _vocab(url: str, key: str, model_id: str) -> int:
    info = requests.post(f"{url}/api/v1/get_info", json={"model_id": model_id}, headers={"X-API-Key": key}, timeout=30)
    info.raise_for_status()
    return int(json.loads((Path(info.json()["model_data"]["tokenizer_id"]) / "config.json").read_text())["vocab_size"])


def normal_session(url: str, key: str, timeout: float = 300) -> list[float]:
    """The official SDK's plain training loop (3 steps of one datum): its losses, which fall on a
    server that still serves normally."""
    import tinker
    from tinker import types

    tc = tinker.ServiceClient(base_url=url, api_key=key).create_lora_training_client(
        base_model="lockstep/tiny", rank=4, seed=0).result(timeout=timeout)
    datum = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                        loss_fn_inputs={"target_tokens": types.TensorData(data=[6, 7, 8], dtype="int64", shape=[3])})
    losses = []
    for _ in range(3):
        fb = tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=timeout)
        losses.append(fb.result(timeout=timeout).metrics["loss:sum"])
    return losses
