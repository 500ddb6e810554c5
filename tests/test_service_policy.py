"""The operator's job policy, datasets, /v1 input bounds and the job state machine, against the API
process alone (no worker) and the scheduler's own checks (no Ray: everything here happens before
an attempt would start)."""

import io
import json
import signal
import subprocess
import sys
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from data_bombs import metadata_bytes, parquet_bomb
from fastapi.testclient import TestClient
from sqlalchemy import select

from lockstep.envs.registry import ALLOWLIST_ENV, resolve_factory
from lockstep.envs.types import EnvError
from lockstep.service.app import ServiceConfig, create_app
from lockstep.service.datacheck import CHECK_MEMORY_BYTES
from lockstep.service.datasets import _verdict
from lockstep.service.db import Job, JobEvent, Tenant, connect
from lockstep.service.jobstate import move
from lockstep.service.policy import Policy, PolicyError
from lockstep.service.scheduler import MAX_INTERRUPTIONS, Scheduler, adopt_orphans, attempt_error
from lockstep.service.storage import Storage
from lockstep.service.tenants import create_tenant
from lockstep.service.types import JobState
from lockstep.service.worker import register_base_models

POLICY = """
max_steps = 5000
[tenants.trusted]
user_env_modules = ["trusted_envs"]
[tenants.small]
max_steps = 10
max_datasets = 2
dataset_quota_bytes = 300
max_dataset_bytes = 200
max_queued_jobs = 2
[tenants.tight]
max_dataset_decoded_bytes = 1048576
"""


@pytest.fixture()
def svc(tmp_path, builtin_dir):
    (tmp_path / "policy.toml").write_text(POLICY)
    policy = Policy.load(tmp_path / "policy.toml")
    cfg = ServiceConfig(db_url=f"sqlite:///{tmp_path / 'db.sqlite'}", storage_url=str(tmp_path / "storage"),
                        max_body_bytes=1 << 20, poll_timeout_s=0.2, policy=policy)
    _, sessions = connect(cfg.db_url)
    with sessions() as s:
        register_base_models(s, {"lockstep/tiny": builtin_dir})
        keys = {name: create_tenant(s, name)[1] for name in ("alice", "bob", "trusted", "small", "tight")}
    with TestClient(create_app(cfg)) as client:
        client.keys, client.sessions, client.policy, client.tmp = keys, sessions, policy, tmp_path
        client.storage = Storage(cfg.storage_url)
        yield client


def call(svc, tenant, method, path, **kw):
    return svc.request(method, f"/v1/{path}", headers={"Authorization": f"Bearer {svc.keys[tenant]}"}, **kw)


def submit(svc, tenant, spec, **body):
    return call(svc, tenant, "POST", "jobs", json={"spec": spec, **body})


def upload(svc, tenant, content: bytes, name="rows.jsonl", **params):
    return call(svc, tenant, "POST", "datasets", params={"name": name, **params}, content=content)


def num_jobs(svc) -> int:
    with svc.sessions() as s:
        return len(list(s.scalars(select(Job.id))))


ROWS = b"".join(json.dumps({"problem": f"{i}+1", "answer": str(i + 1)}).encode() + b"\n" for i in range(20))


# -- the policy file ----------------------------------------------------------------------------------
def test_the_policy_file_has_safe_defaults_and_per_tenant_overrides(tmp_path):
    default = Policy()
    assert default.limits.user_env_modules == () and default.limits.max_wall_seconds == 6 * 3600
    (tmp_path / "p.toml").write_text(POLICY)
    policy = Policy.load(tmp_path / "p.toml")
    assert policy.for_tenant("alice").max_steps == 5000 and policy.for_tenant("nobody").max_steps == 5000
    assert policy.for_tenant("small").max_steps == 10 and policy.for_tenant("small").max_env_workers == 8
    assert policy.for_tenant("trusted").user_env_modules == ("trusted_envs",)
    (tmp_path / "bad.toml").write_text("max_step = 3\n")
    with pytest.raises(PolicyError, match="max_step: unknown key; did you mean 'max_steps'"):
        Policy.load(tmp_path / "bad.toml")
    (tmp_path / "bad.toml").write_text("[tenants.x]\nmax_wall_seconds = -1\n")
    with pytest.raises(PolicyError, match="tenants.x.max_wall_seconds: expected a number >= 1"):
        Policy.load(tmp_path / "bad.toml")
    (tmp_path / "bad.toml").write_text('user_env_modules = ["../x"]\n')
    with pytest.raises(PolicyError, match="user_env_modules"):
        Policy.load(tmp_path / "bad.toml")
    r = subprocess.run([sys.executable, "-m", "lockstep.cli", "serve", "--policy", str(tmp_path / "bad.toml")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--policy" in r.stderr and "user_env_modules" in r.stderr


# -- env.name ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["os:system", "builtins:eval", "subprocess:run", "lockstep.service.app:create_app",
                                  "lockstep.envs.arithmetic:make_suite", ".arithmetic:make_suite",
                                  "..service:x", "trusted_envs:make"])
def test_env_modules_are_refused_unless_the_operator_allows_them(svc, name):
    r = submit(svc, "alice", {"env": {"name": name}})
    assert r.status_code == 400 and "env.name" in r.json()["error"], r.text
    assert num_jobs(svc) == 0


def test_an_allowlisted_module_is_accepted_for_its_tenant_only(svc):
    assert submit(svc, "trusted", {"env": {"name": "trusted_envs.sub:make"}}).status_code == 200
    for name in ("trusted_envsx:make", "os:system", ".trusted_envs:make", "trusted_envs:make.x"):
        r = submit(svc, "trusted", {"env": {"name": name}})
        assert r.status_code == 400 and "env.name" in r.json()["error"], (name, r.text)
    assert num_jobs(svc) == 1


def test_the_job_process_refuses_modules_outside_the_allowlist(monkeypatch):
    """Defence in depth: the scheduler sets the allowlist on the `lockstep run` it starts, and the
    env registry refuses anything else there, whatever spec reached it."""
    monkeypatch.setenv(ALLOWLIST_ENV, "")
    for name in ("os:system", "json:loads", "lockstep.envs.arithmetic:make_suite"):
        with pytest.raises(EnvError, match="not allowed"):
            resolve_factory(name)
    assert callable(resolve_factory("arithmetic"))
    monkeypatch.setenv(ALLOWLIST_ENV, "json")
    assert callable(resolve_factory("json:loads"))
    with pytest.raises(EnvError, match="not allowed"):
        resolve_factory("jsonschema:validate")
    monkeypatch.delenv(ALLOWLIST_ENV)  # `lockstep run` on your own machine: any module
    assert callable(resolve_factory("json:loads"))


# -- model.path ----------------------------------------------------------------------------------------
def finished_job(svc, tenant: str, state="succeeded") -> str:
    """A job row as the worker leaves it (the API alone cannot run one)."""
    with svc.sessions() as s:
        tid = s.scalar(select(Tenant.id).where(Tenant.name == tenant))
        job = Job(id=f"{abs(hash((tenant, state))) % 16**16:016x}", tenant_id=tid, spec={}, state=state)
        s.add(job)
        s.commit()
        return job.id


@pytest.mark.parametrize("path", ["/etc", "/tmp/x", "../../etc", "./model", "a/../../b", "%2e%2e/etc",
                                  "~/.cache/lockstep", "C:\\x", "lockstep/tiny/../../..", "jobs:abc"])
def test_model_path_is_never_a_path(svc, path):
    r = submit(svc, "alice", {"model": {"path": path}})
    assert r.status_code == 400 and "model.path" in r.json()["error"], r.text
    assert num_jobs(svc) == 0


def test_model_path_is_a_base_model_or_one_of_your_final_models(svc):
    assert submit(svc, "alice", {"model": {"path": "lockstep/tiny"}}).status_code == 200
    assert submit(svc, "alice", {"model": {"path": "builtin"}}).status_code == 200
    mine, theirs = finished_job(svc, "alice"), finished_job(svc, "bob")
    failed = finished_job(svc, "alice", "failed")
    assert submit(svc, "alice", {"model": {"path": f"job:{mine}"}}).status_code == 200
    refused = [submit(svc, "alice", {"model": {"path": f"job:{j}"}}) for j in (theirs, failed, "0" * 16)]
    assert {r.status_code for r in refused} == {400}
    assert len({r.json()["error"].replace(j, "ID") for r, j in zip(refused, (theirs, failed, "0" * 16))}) == 1


# -- datasets ------------------------------------------------------------------------------------------
def test_datasets_are_validated_on_upload_and_only_their_owner_uses_them(svc):
    ds = upload(svc, "alice", ROWS).json()
    assert ds["id"].startswith("ds-") and ds["num_rows"] == 20 and ds["format"] == "jsonl"
    table = pa.table({"prompt": ["1+1="], "completion": ["2"]})
    buf = io.BytesIO()
    pq.write_table(table, buf)
    pds = upload(svc, "alice", buf.getvalue(), name="sft.parquet").json()
    assert pds["format"] == "parquet" and pds["num_rows"] == 1
    spec = {"env": {"name": "math", "path": ds["id"], "test_path": ds["id"], "num_heldout": 5},
            "stages": [{"kind": "sft", "steps": 1, "dataset": pds["id"]}]}
    assert submit(svc, "alice", spec).status_code == 200
    r = submit(svc, "bob", spec)
    assert r.status_code == 400 and "you have no dataset" in r.json()["error"]
    assert call(svc, "bob", "GET", f"datasets/{ds['id']}").status_code == 404
    assert call(svc, "bob", "DELETE", f"datasets/{ds['id']}").status_code == 404
    assert [d["id"] for d in call(svc, "alice", "GET", "datasets").json()["datasets"]] == [ds["id"], pds["id"]]
    assert call(svc, "bob", "GET", "datasets").json()["datasets"] == []
    r = call(svc, "alice", "DELETE", f"datasets/{ds['id']}")
    assert r.status_code == 409 and "used by job" in r.json()["error"]  # a queued job needs it


@pytest.mark.parametrize("content, name, message", [
    (b'{"a": 1}\n{"a": \n', "x.jsonl", "line 2: invalid JSON"),
    (b'[1, 2]\n', "x.jsonl", "line 1: expected a JSON object"),
    (b'\xff\xfe{}\n', "x.jsonl", "line 1: not UTF-8"),
    (b"\n\n", "x.jsonl", "no rows"),
    (b"[" * 100_000 + b"]" * 100_000 + b"\n", "x.jsonl", "invalid JSON"),
    (b"PAR1 not really", "x.parquet", "not a readable parquet file"),
    (b"{}\n", "x.csv", "cannot tell the format"),
    (b"{}\n", "../../etc/passwd.jsonl", "a label, not a path"),
    (b"{}\n", "/abs.jsonl", "a label, not a path"),
])
def test_a_bad_upload_is_refused_and_stores_nothing(svc, content, name, message):
    r = upload(svc, "alice", content, name=name)
    assert r.status_code == 400 and message in r.json()["error"], r.text
    assert call(svc, "alice", "GET", "datasets").json()["datasets"] == []
    assert not (svc.tmp / "storage" / "datasets").exists() or not any((svc.tmp / "storage" / "datasets").rglob("*.*"))


def test_dataset_size_cap_and_quota(svc):
    r = upload(svc, "small", b'{"a": "' + b"x" * 300 + b'"}\n')
    assert r.status_code == 413 and "max_dataset_bytes = 200" in r.json()["error"]
    first = upload(svc, "small", b'{"a": "' + b"x" * 150 + b'"}\n')
    assert first.status_code == 200
    r = upload(svc, "small", b'{"a": "' + b"x" * 150 + b'"}\n')
    assert r.status_code == 429 and "dataset_quota_bytes = 300" in r.json()["error"]
    assert [d["id"] for d in call(svc, "small", "GET", "datasets").json()["datasets"]] == [first.json()["id"]]
    assert len(list((svc.tmp / "storage" / "datasets").rglob("*.jsonl"))) == 1  # the refused one is not kept
    for _ in range(1):
        assert upload(svc, "small", b"{}\n").status_code == 200
    r = upload(svc, "small", b"{}\n")
    assert r.status_code == 429 and "at most 2" in r.json()["error"]
    assert call(svc, "small", "GET", "usage").json()["dataset_bytes"] == first.json()["size_bytes"] + 3
    assert call(svc, "small", "DELETE", f"datasets/{first.json()['id']}").status_code == 200
    assert len(list((svc.tmp / "storage" / "datasets").rglob("*.jsonl"))) == 1
    assert upload(svc, "small", b"{}\n").status_code == 200


def assert_nothing_stored(svc, tenant):
    assert call(svc, tenant, "GET", "datasets").json()["datasets"] == []
    assert not (svc.tmp / "storage" / "datasets").exists() or not any((svc.tmp / "storage" / "datasets").rglob("*.*"))


@pytest.mark.parametrize("num_rows, arrow_schema, under", [(20_000, True, 1024), (200_000, False, 2048)],
                         ids=["2GB-in-under-1KB", "20GB-in-under-2KB"])
def test_a_parquet_bomb_is_refused_by_what_it_decodes_to(svc, num_rows, arrow_schema, under):
    bomb = parquet_bomb(num_rows, 100_000, arrow_schema=arrow_schema)
    limits = svc.policy.for_tenant("alice")
    assert len(bomb) < under and num_rows * 100_000 >= 2 * 10**9
    # Control: the old check bounded the footer's total_byte_size (the dictionary page, once) by
    # 8 x max_dataset_bytes, and let both through.
    assert metadata_bytes(bomb) < 200_000 < 8 * limits.max_dataset_bytes
    r = upload(svc, "alice", bomb, name="bomb.parquet")
    assert r.status_code == 400, r.text
    assert f"decodes to more than this server's cap max_dataset_decoded_bytes = {512 << 20}" in r.json()["error"]
    assert limits.max_dataset_decoded_bytes == 512 << 20
    assert_nothing_stored(svc, "alice")


def test_the_decoded_cap_is_the_tenants_and_counts_expanded_rows(svc):
    """Tenant `tight` may store 1 MiB of decoded rows: 100 rows of a dictionary-encoded 8 KB prompt
    (8,000 to 9,000 bytes each as Python objects) fit, 140 do not; 100k empty dicts in one jsonl
    line (300 KB of text, 100k x sys.getsizeof({}) = 6.4 MB in memory) do not either."""
    ok = upload(svc, "tight", parquet_bomb(100, 8_000), name="ok.parquet")
    assert ok.status_code == 200 and ok.json()["num_rows"] == 100, ok.text
    r = upload(svc, "tight", parquet_bomb(140, 8_000), name="over.parquet")
    assert r.status_code == 400 and "max_dataset_decoded_bytes = 1048576" in r.json()["error"], r.text
    dicts = json.dumps({"prompt": [{}] * 100_000}).encode() + b"\n"
    r = upload(svc, "tight", dicts)
    assert r.status_code == 400 and "max_dataset_decoded_bytes = 1048576" in r.json()["error"], r.text
    assert upload(svc, "alice", dicts).status_code == 200  # control: within the default cap
    assert [d["id"] for d in call(svc, "tight", "GET", "datasets").json()["datasets"]] == [ok.json()["id"]]


def check_in_process(path, cap: int, memory: int) -> dict:
    r = subprocess.run([sys.executable, "-B", "-m", "lockstep.service.datacheck", str(path), "parquet", str(cap),
                        str(memory)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_the_check_decodes_in_a_process_of_bounded_memory(tmp_path):
    """One 100 MB value compresses to a 3.5 KB file, within a 512 MiB decoded cap, but its page,
    arrow array and str take ~300 MB at once: the check's process refuses it when its memory is
    bounded to 250 MB, and (control) decodes it with 1 GiB, the bound uploads are checked under."""
    path = tmp_path / "one.parquet"
    pq.write_table(pa.table({"prompt": ["y" * 100_000_000]}), path, compression="zstd", compression_level=1)
    assert path.stat().st_size < 8192
    verdict = check_in_process(path, 512 << 20, 250 << 20)
    assert verdict == {"refused": "dataset needs more than 262144000 bytes of memory to decode (one parquet page, "
                                  "value or batch of 64 rows inflates past it)"}
    assert check_in_process(path, 512 << 20, CHECK_MEMORY_BYTES) == {"rows": 1} and CHECK_MEMORY_BYTES == 1 << 30


@pytest.mark.parametrize("returncode, stdout, stderr, message", [
    (-signal.SIGXCPU, b"", b"", "dataset takes more than 60 s of CPU time to decode"),
    (-signal.SIGKILL, b"", b"", "dataset takes more than 60 s of CPU time to decode"),
    (1, b"", b"Traceback ...\nMemoryError\n", f"dataset needs more than {1 << 30} bytes of memory to decode"),
    (-signal.SIGSEGV, b"", b"", "dataset could not be read: the check stopped with exit status -11"),
    (0, b"not json", b"", "dataset could not be read: the check stopped with exit status 0"),
    (0, b'{"rows": "3"}', b"", "dataset could not be read: the check stopped with exit status 0"),
])
def test_a_check_that_dies_refuses_the_file(returncode, stdout, stderr, message):
    """Killed past its CPU time or memory, or crashed in the reader on a crafted file: a 400 that says
    so, never a 500 or an accepted file."""
    done = subprocess.CompletedProcess([], returncode, stdout, stderr)
    assert _verdict(done) == {"refused": message}
    assert _verdict(subprocess.CompletedProcess([], 0, b'{"rows": 3}\n', b"")) == {"rows": 3}


@pytest.mark.parametrize("field", ["env.path", "env.test_path", "stages.0.dataset"])
@pytest.mark.parametrize("value", ["/etc/passwd", "../../service.db", "..%2f..%2fservice.db", "ds-../../x",
                                   "file:///etc/passwd", "s3://bucket/key", "rows.jsonl", "ds-0123456789abcdeg"])
def test_data_fields_take_dataset_ids_only(svc, field, value):
    spec = {"env": {"name": "math", "path": "ds-0123456789abcdef"}, "stages": [{"kind": "sft", "steps": 1}]}
    section, key = field.rsplit(".", 1)
    node = spec["stages"][0] if section == "stages.0" else spec["env"]
    node[key] = value
    r = submit(svc, "alice", spec)
    assert r.status_code == 400 and ("dataset id" in r.json()["error"] or "dataset" in r.json()["error"]), r.text
    assert num_jobs(svc) == 0


# -- caps ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, cap", [
    ({"runtime": {"env_workers": 9}}, "max_env_workers = 8"),
    ({"runtime": {"generator_threads": 9}}, "max_threads = 8"),
    ({"runtime": {"trainer_threads": 64}}, "max_threads = 8"),
    ({"runtime": {"max_restarts": 6}}, "max_restarts = 5"),
    ({"runtime": {"keep_checkpoints": 11}}, "max_keep_checkpoints = 10"),
    ({"stages": [{"kind": "rl", "steps": 5001}]}, "max_steps = 5000"),
    ({"stages": [{"kind": "sft", "steps": 3000}, {"kind": "rl", "steps": 3000}]}, "max_steps = 5000"),
    ({"stages": [{"kind": "rl", "steps": 1}] * 9}, "max_stages = 8"),
    ({"stages": [{"kind": "sft", "batch_size": 4096}]}, "max_batch_size = 1024"),
    ({"stages": [{"kind": "rl", "group_size": 1000}]}, "max_group_size = 64"),
    ({"stages": [{"kind": "rl", "prompts_per_step": 10**6}]}, "max_prompts_per_step = 256"),
    ({"env": {"name": "reasoning_gym", "task": "basic_arithmetic", "size": 10**9}}, "max_env_size = 100000"),
    ({"env": {"num_heldout": 10**6}}, "max_num_heldout = 5000"),
    ({"env": {"max_tokens": 10**6}}, "max_tokens = 2048"),
    ({"env": {"pass_k": 1000}}, "max_pass_k = 64"),
    ({"env": {"max_turns": 100}}, "max_turns = 16"),
    ({"env": {"retries": 100}}, "max_env_retries = 10"),
    ({"model": {"lora_rank": 4096}}, "max_lora_rank = 256"),
    ({"env": {"prompt_template": "{question}" + "x" * 70_000}}, "longer than 4096"),
])
def test_a_job_over_a_cap_is_refused_naming_the_cap(svc, spec, cap):
    r = submit(svc, "alice", spec)
    assert r.status_code == 400 and cap in r.json()["error"], r.text
    assert num_jobs(svc) == 0


def test_caps_apply_per_tenant(svc):
    spec = {"stages": [{"kind": "rl", "steps": 11}]}
    assert submit(svc, "alice", spec).status_code == 200
    r = submit(svc, "small", spec)
    assert r.status_code == 400 and "max_steps = 10" in r.json()["error"]
    ok = {"stages": [{"kind": "rl", "steps": 10}]}
    assert [submit(svc, "small", ok).status_code for _ in range(3)] == [200, 200, 429]  # max_queued_jobs = 2


# -- /v1 bounds ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("params", [{"after": 2**64}, {"after": 2**63}, {"after": -1}, {"after": "x"},
                                    {"follow": "maybe"}])
def test_event_cursors_out_of_range_are_400(svc, params):
    job = submit(svc, "alice", {}).json()["id"]
    r = call(svc, "alice", "GET", f"jobs/{job}/events", params={"follow": "false", **params})
    assert r.status_code == 400 and r.json()["category"] == "user", r.text
    ok = call(svc, "alice", "GET", f"jobs/{job}/events", params={"follow": "false", "after": 2**63 - 1})
    assert ok.status_code == 200 and ok.text.startswith("event: end")


@pytest.mark.parametrize("request_", [
    ("GET", "jobs", {"params": {"state": "bogus"}}),
    ("GET", "jobs", {"params": {"limit": 0}}),
    ("GET", "jobs", {"params": {"limit": 2**70}}),
    ("POST", "jobs", {"json": {"spec": {}, "name": "x" * 129}}),
    ("POST", "jobs", {"json": {"spec": {}, "max_attempts": 0}}),
    ("POST", "jobs", {"json": {"spec": {}, "max_attempts": 11}}),
    ("POST", "jobs", {"json": {"spec": {}, "max_attempts": 2**64}}),
    ("POST", "jobs", {"json": {"spec": {}, "priority": "urgent"}}),
    ("POST", "jobs", {"json": {"spec": {"seed": 2**70}}}),
    ("POST", "jobs", {"json": {"spec": {"seed": -1}}}),
    ("POST", "jobs", {"json": {"spec": {"env": {"args": {"a": {"b": {"c": {"d": {"e": {"f": {"g": {}}}}}}}}}}}}),
    ("POST", "jobs", {"json": {"spec": {"stages": [{"kind": "rl", "loss_config": {"tis_cap": "big"}}]}}}),
    ("POST", "jobs", {"json": {"spec": {"model": "builtin"}}}),
    ("POST", "jobs", {"json": {"spec": {"stages": {"kind": "rl"}}}}),
    ("POST", "jobs", {"json": {"spec": {"runtime": {"ray_address": "10.0.0.1:6379"}}}}),
    ("POST", "jobs", {"content": b'{"spec": {"env": {"timeout_s": Infinity}}}',
                      "headers": {"content-type": "application/json"}}),
    ("POST", "jobs", {"content": b'{"spec": {"env": {"timeout_s": NaN}}}', "headers": {"content-type": "application/json"}}),
    ("POST", "datasets", {"params": {"name": "x" * 129 + ".jsonl"}, "content": b"{}\n"}),
    ("POST", "datasets", {"params": {"name": "x.jsonl", "format": "csv"}, "content": b"{}\n"}),
    ("GET", "jobs/0123/logs", {"params": {"attempt": 0}}),
])
def test_every_v1_field_is_range_checked(svc, request_):
    method, path, kw = request_
    if "headers" in kw:
        kw["headers"] = {**kw["headers"], "Authorization": f"Bearer {svc.keys['alice']}"}
        r = svc.request(method, f"/v1/{path}", **kw)
    else:
        r = call(svc, "alice", method, path, **kw)
    assert 400 <= r.status_code < 500 and r.json()["category"] == "user", r.text
    assert num_jobs(svc) == 0


def test_job_ids_take_any_unique_prefix(svc):
    ids = [submit(svc, "alice", {}).json()["id"] for _ in range(17)]  # two share a first digit
    one = ids[0]
    assert call(svc, "alice", "GET", f"jobs/{one[:10]}").json()["id"] == one
    assert call(svc, "alice", "GET", f"jobs/{one[:10]}/events", params={"follow": "false"}).status_code == 200
    shared = next(a[0] for a in ids if sum(b[0] == a[0] for b in ids) > 1)
    r = call(svc, "alice", "GET", f"jobs/{shared}")
    assert r.status_code == 400 and "give more of the id" in r.json()["error"]
    assert call(svc, "bob", "GET", f"jobs/{one[:10]}").status_code == 404  # another tenant's: unknown
    assert call(svc, "bob", "GET", f"jobs/{shared}").status_code == 404
    for bad in ("%2e%2e", "g", "ABC"):
        assert call(svc, "alice", "GET", f"jobs/{bad}").status_code == 404
    assert call(svc, "alice", "POST", f"jobs/{one[:12]}/cancel").json()["state"] == "cancelled"


def test_the_final_model_streams_as_a_tar(svc, tmp_path):
    job = finished_job(svc, "alice")
    with svc.sessions() as s:
        tid = s.get(Job, job).tenant_id
    model = tmp_path / "m"
    model.mkdir()
    blob = bytes(range(256)) * (3 * 4096 + 7)  # ~3 MB: several chunks
    (model / "model.safetensors").write_bytes(blob)
    (model / "config.json").write_text("{}")
    (model / "MANIFEST.json").write_text("{}")
    svc.storage.put_dir(model, f"jobs/{tid}/{job}/final_model")
    r = call(svc, "alice", "GET", f"jobs/{job[:8]}/artifacts/final_model.tar")
    assert r.status_code == 200 and "content-length" not in r.headers  # streamed, not built in memory
    tar = tarfile.open(fileobj=io.BytesIO(r.content))
    assert tar.extractfile("final_model/model.safetensors").read() == blob
    assert sorted(tar.getnames()) == ["final_model/MANIFEST.json", "final_model/config.json",
                                      "final_model/model.safetensors"]
    assert call(svc, "bob", "GET", f"jobs/{job}/artifacts/final_model.tar").status_code == 404


# -- the state machine ---------------------------------------------------------------------------------
def queued_job(svc, tenant="alice") -> str:
    return submit(svc, tenant, {}).json()["id"]


def states(svc, job_id) -> list[str]:
    with svc.sessions() as s:
        return [e.data["state"] for e in s.scalars(select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.kind == "state")
                                                   .order_by(JobEvent.id))]


def test_a_move_is_a_compare_and_set(svc):
    job_id = queued_job(svc)
    with svc.sessions() as a, svc.sessions() as b:
        ja, jb = a.get(Job, job_id), b.get(Job, job_id)  # both read "queued"
        assert move(a, ja, JobState.STARTING)
        a.commit()
        assert not move(b, jb, JobState.CANCELLED)  # its read is stale: it loses
        assert jb.state == "starting"  # and sees what won
        assert move(b, jb, JobState.CANCELLING)
        b.commit()
    assert states(svc, job_id) == ["queued", "starting", "cancelling"]


def scheduler(svc) -> Scheduler:
    return Scheduler(svc.sessions, svc.storage, svc.tmp / "worker", "", policy=svc.policy)


def test_cancel_racing_the_schedulers_start_wins_and_the_job_never_runs(svc):
    """The scheduler has read the job as queued when the tenant cancels it; its start must then
    fail (before this, the job went queued -> cancelled -> running -> succeeded)."""
    job_id = queued_job(svc)
    sched = scheduler(svc)
    with svc.sessions() as s:
        job = sched._waiting(s)[0]
        tenant = s.get(Tenant, job.tenant_id)
        assert call(svc, "alice", "POST", f"jobs/{job_id}/cancel").json()["state"] == "cancelled"
        assert sched._start(s, job, tenant) is False
    assert sched.running == {} and not (svc.tmp / "worker" / "jobs" / job_id).exists()
    assert states(svc, job_id) == ["queued", "cancelled"]
    assert call(svc, "alice", "GET", f"jobs/{job_id}").json()["state"] == "cancelled"


def test_the_scheduler_refuses_a_spec_written_behind_the_apis_back(svc):
    with svc.sessions() as s:
        tid = s.scalar(select(Tenant.id).where(Tenant.name == "alice"))
        for i, spec in enumerate(({"env": {"name": "os:system"}}, {"model": {"path": "/etc"}},
                                  {"env": {"name": "math", "path": "/etc/passwd"}}, {"runtime": {"env_workers": 99}})):
            s.add(Job(id=f"{i:016x}", tenant_id=tid, spec=spec, state="queued"))
        s.commit()
    sched = scheduler(svc)
    with svc.sessions() as s:
        tenant = s.scalar(select(Tenant).where(Tenant.name == "alice"))
        for job in sched._waiting(s):
            assert sched._start(s, job, tenant) is False
    for i, needle in enumerate(("env.name", "model.path", "env.path", "max_env_workers")):
        job = call(svc, "alice", "GET", f"jobs/{i:016x}").json()
        assert job["state"] == "failed" and job["attempts"] == 0, job
        assert job["error"].startswith("refused by the worker's policy") and needle in job["error"]
    assert sched.running == {} and not (svc.tmp / "worker" / "jobs").exists()


def test_adopting_orphans_goes_through_the_state_machine(svc):
    """A dead worker's jobs: those it was starting, running or preempting go back to the queue
    with their attempt given back and the interruption counted (a job with max_attempts = 1
    interrupted again and again never shows 2 attempts); a job interrupted MAX_INTERRUPTIONS
    times fails; one being cancelled ends cancelled; one state event per change."""
    paths = {"starting": ["starting"], "running": ["starting", "running"],
             "preempting": ["starting", "running", "preempting"], "cancelling": ["starting", "cancelling"],
             "done": ["starting", "running", "succeeded"], "worn": ["starting", "running"]}
    ids = {name: submit(svc, "alice", {}, max_attempts=1).json()["id"] for name in paths}
    with svc.sessions() as s:
        for name, path in paths.items():
            job = s.get(Job, ids[name])
            for to in path:
                assert move(s, job, JobState(to), **({"attempts": 1} if to == "starting" else {}))
        s.get(Job, ids["worn"]).interruptions = MAX_INTERRUPTIONS
        s.commit()
    assert adopt_orphans(svc.sessions) == 3
    for name in ("starting", "running", "preempting"):
        job = call(svc, "alice", "GET", f"jobs/{ids[name]}").json()
        assert (job["state"], job["attempts"], job["interruptions"]) == ("queued", 0, 1), job
        assert states(svc, ids[name]) == ["queued", *paths[name], "queued"]
    assert states(svc, ids["cancelling"]) == ["queued", "starting", "cancelling", "cancelled"]
    assert states(svc, ids["done"]) == ["queued", "starting", "running", "succeeded"]
    worn = call(svc, "alice", "GET", f"jobs/{ids['worn']}").json()
    assert worn["state"] == "failed" and f"at most {MAX_INTERRUPTIONS}" in worn["error"]


def test_a_failed_attempts_error_is_a_message_not_a_traceback(tmp_path):
    job_dir = tmp_path / "jobs" / "0123456789abcdef"
    (job_dir / "inputs").mkdir(parents=True)
    r = subprocess.run([sys.executable, "-m", "lockstep.cli", "run", "env.name=math",
                        f"env.path={job_dir / 'inputs' / 'ds-0.jsonl'}"], capture_output=True, text=True, timeout=300)
    message = attempt_error(r.stdout + r.stderr, job_dir)
    assert message == "env: data file 'inputs/ds-0.jsonl' does not exist", message
    r = subprocess.run([sys.executable, "-c", "import json; json.loads('{')"], capture_output=True, text=True)
    assert "Traceback" in r.stderr and "/" in r.stderr
    message = attempt_error(r.stderr, job_dir)
    assert message.startswith("json.decoder.JSONDecodeError: Expecting property name") and "/" not in message
