"""The service on PostgreSQL and S3: a real PostgreSQL server and moto's S3 server, started here.

scripts/setup.sh installs PostgreSQL when it runs as root (CI does); elsewhere these tests skip
with the reason, unless LOCKSTEP_REQUIRE_SERVICES=1 (set by .ci/run) turns that into a failure.
"""

import glob
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np
import pytest
import tinker
from helpers import free_port
from required import unavailable
from sqlalchemy import func, select
from test_service_sdk import logprobs, make_server, sft_datum
from tinker import types

from lockstep.service import queue
from lockstep.service.db import Request, connect
from lockstep.service.tenants import create_tenant
from lockstep.service.types import RequestKind

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")


def _as_postgres(cmd: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


@pytest.fixture(scope="module")
def postgres_url(tmp_path_factory):
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl")) or ([shutil.which("pg_ctl")] if shutil.which("pg_ctl") else [])
    if not found:
        unavailable("PostgreSQL is not installed (scripts/setup.sh installs it when run as root)")
    bin_dir = Path(found[-1]).parent
    # Not under pytest's tmp dirs: they are private to this user, and the server runs as postgres.
    root = Path(tempfile.mkdtemp(prefix="lockstep-pg-"))
    data, sock = root / "data", root / "sock"
    sock.mkdir()
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
        shutil.chown(sock, "postgres")
    port = free_port()
    subprocess.run(_as_postgres([str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres"]),
                   check=True, capture_output=True)
    opts = f"-p {port} -k {sock} -c listen_addresses=127.0.0.1 -c fsync=off"
    subprocess.run(_as_postgres([str(bin_dir / "pg_ctl"), "-D", str(data), "-o", opts, "-w", "-l", str(root / "log"),
                                 "start"]), check=True, capture_output=True)
    subprocess.run(_as_postgres([str(bin_dir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres",
                                 "lockstep"]), check=True, capture_output=True)
    yield f"postgresql+psycopg://postgres@127.0.0.1:{port}/lockstep"
    subprocess.run(_as_postgres([str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"]),
                   capture_output=True)
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    try:
        import boto3
        from moto.server import ThreadedMotoServer
    except ImportError:
        unavailable("moto[server] is not installed (it is in the dev extras)")
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
           "AWS_DEFAULT_REGION": "us-east-1"}
    client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id="test",
                          aws_secret_access_key="test", region_name="us-east-1")
    client.create_bucket(Bucket="lockstep-test")
    yield env, client
    server.stop()


def test_claims_are_exclusive_on_postgres(postgres_url):
    _, sessions = connect(postgres_url)
    with sessions() as s:
        tenant, _ = create_tenant(s, "claims")
        req = queue.submit(s, tenant_id=tenant.id, kind=RequestKind.SAMPLE, payload=b"{}", sampling_session_id="x")
    wins = []

    def claim(i):
        with sessions() as s:
            if queue.claim(s, req, f"worker-{i}") is not None:
                wins.append(f"worker-{i}")

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1  # eight workers raced for it; one ran it
    with sessions() as s:  # only the winner may finish it
        assert not queue.finish(s, req.id, "worker-none", error="not the claimant")
        # the database is the module's: leave no running request for the next test's worker
        assert queue.finish(s, req.id, wins[0], error="claimed by the race test")


class in_process_reference:
    """The engine itself, driven like the service drives it (same LoRA shape, Adam defaults of the
    SDK, sampler on the trained weights)."""

    def __init__(self, data, *, steps: int, lora: dict):
        from lockstep.engine.sampler import Sampler
        from lockstep.engine.tiny import ensure_tiny_model
        from lockstep.engine.trainer import Trainer
        from lockstep.engine.types import AdamParams, Datum
        from lockstep.service.host import lora_spec

        self.trainer = Trainer.from_pretrained(ensure_tiny_model(), lora=lora_spec(lora))
        self.data = [Datum(tuple(d.model_input.to_ints()), {k: v.to_numpy() for k, v in d.loss_fn_inputs.items()})
                     for d in data]
        adam = AdamParams(**types.AdamParams(learning_rate=1e-2).model_dump())
        for _ in range(steps):
            self.trainer.forward_backward(self.data, "cross_entropy")
            self.trainer.optim_step(adam)
        self.sampler = Sampler(self.trainer.model, self.trainer.tokenizer)

    def forward(self, _data) -> list[np.ndarray]:
        return [o["logprobs"] for o in self.trainer.forward(self.data, "cross_entropy").loss_fn_outputs]

    def sample(self, prompt, *, num_samples: int, max_tokens: int, seed: int) -> list[tuple]:
        from lockstep.engine.types import SampleRequest, SamplingParams

        [res] = self.sampler.sample([SampleRequest(tuple(prompt), SamplingParams(max_tokens=max_tokens, seed=seed),
                                                   num_samples=num_samples)])
        return [(s.tokens, s.logprobs) for s in res.sequences]


def test_sdk_session_on_postgres_and_s3(tmp_path, postgres_url, s3):
    env, client = s3
    srv = make_server(tmp_path, db=postgres_url, storage="s3://lockstep-test/service", env=env)
    key = srv.key("dana")
    srv.start()
    try:
        sc = tinker.ServiceClient(base_url=srv.url, api_key=key)
        tc = sc.create_lora_training_client(base_model="lockstep/tiny", rank=4, seed=3).result()
        tok = tc.get_tokenizer()
        data = [sft_datum(tok, f"{a}+{a}=", f"{2 * a:02d}") for a in range(6)]
        for _ in range(3):
            tc.forward_backward(data, "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        path = tc.save_state("pg-s3").result().path
        back = sc.create_training_client_from_state_with_optimizer(path).result()
        want, got = logprobs(tc.forward(data, "cross_entropy").result()), logprobs(back.forward(data, "cross_entropy").result())
        assert all((a == b).all() for a, b in zip(want, got))
        sampler = sc.create_sampling_client(model_path=tc.save_weights_for_sampler("s").result().path)
        res = sampler.sample(prompt=types.ModelInput.from_ints(tok.encode("3+3=")), num_samples=2,
                             sampling_params=types.SamplingParams(max_tokens=3, seed=0)).result()
        # The same steps on an in-process trainer: the server on PostgreSQL and S3 trained, stored
        # and sampled exactly what the engine does (tokens and logprobs bit for bit).
        local = in_process_reference(data, steps=3, lora={"rank": 4, "seed": 3})
        assert all((a == b).all() for a, b in zip(want, local.forward(data)))
        expected = local.sample(tok.encode("3+3="), num_samples=2, max_tokens=3, seed=0)
        assert [(tuple(s.tokens), tuple(s.logprobs)) for s in res.sequences] == expected
    finally:
        srv.stop()
    keys = [o["Key"] for o in client.list_objects_v2(Bucket="lockstep-test", Prefix="service/")["Contents"]]
    assert any(k.endswith("/weights/pg-s3/MANIFEST.json") for k in keys)  # the checkpoint lives in S3
    assert any(k.endswith("/sampler_weights/s/model.safetensors") for k in keys)
    _, sessions = connect(postgres_url)
    with sessions() as s:  # and the queue in PostgreSQL
        assert s.scalar(select(func.count()).select_from(Request).where(Request.kind == "forward_backward")) >= 3
