"""A hostile tenant against the job service (/v1): bob goes after alice's job (its state, events,
logs, artifacts and final model), her datasets and her usage, by id, by prefix and by path, and
puts traversal, absolute and encoded paths and module names in every path-like field of a job
spec. Everything is refused with a 4xx and nothing is created."""

import json
from pathlib import Path

import pytest

from test_service_jobs import api, submit, wait_state
from test_service_sdk import make_server


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A live server; alice has a finished job (artifacts, final model, logs) and a dataset."""
    srv = make_server(tmp_path_factory.mktemp("hostile"))
    srv.keys = {"alice": srv.key("alice"), "bob": srv.key("bob")}
    srv.home_jobs = Path(srv.env["LOCKSTEP_HOME"]) / "service" / "worker" / "jobs"
    srv.start()
    srv.job = submit(srv, "alice", "rl.steps=1", name="alice's")
    done = wait_state(srv, "alice", srv.job, ("succeeded", "failed"))
    assert done["state"] == "succeeded", done["error"]
    r = api(srv, "alice", "POST", "datasets", params={"name": "secret.jsonl"},
            content=b"".join(json.dumps({"problem": f"{i}+1", "answer": str(i + 1)}).encode() + b"\n" for i in range(30)))
    srv.dataset = r.json()["id"]
    srv.dataset_file = next(Path(srv.storage).rglob(f"{srv.dataset}.jsonl"))
    srv.job_dirs = sorted(p.name for p in srv.home_jobs.iterdir())  # $LOCKSTEP_HOME may hold other servers' jobs
    yield srv
    srv.stop()


def refused(r) -> bool:
    return 400 <= r.status_code < 500


# -- alice's objects, by id, prefix and path -------------------------------------------------------
def targets(w) -> list[tuple[str, str, dict]]:
    j, ds = w.job, w.dataset
    return [("GET", f"jobs/{j}", {}), ("GET", f"jobs/{j[:6]}", {}), ("GET", f"jobs/{j[:1]}", {}),
            ("POST", f"jobs/{j}/cancel", {}), ("POST", f"jobs/{j[:8]}/cancel", {}),
            ("GET", f"jobs/{j}/events", {"params": {"follow": "false"}}),
            ("GET", f"jobs/{j[:4]}/events", {"params": {"follow": "true", "after": 0}}),
            ("GET", f"jobs/{j}/logs", {}), ("GET", f"jobs/{j}/logs", {"params": {"attempt": 1}}),
            *[("GET", f"jobs/{j}/artifacts/{a}", {}) for a in ("report.html", "summary.json", "metrics.jsonl",
                                                                "config.json", "final_model.tar")],
            ("GET", f"jobs/{j[:5]}/artifacts/final_model.tar", {}),
            ("GET", f"datasets/{ds}", {}), ("DELETE", f"datasets/{ds}", {}),
            ("GET", f"jobs/..%2f..%2fjobs%2f{j}", {}), ("GET", f"jobs/{j}%2f..", {}),
            ("GET", f"jobs/{j}/artifacts/..%2f..%2f..%2fservice.db", {}),
            ("GET", f"jobs/{j}/artifacts/%2e%2e%2fsummary.json", {}),
            ("GET", f"jobs/{j}/artifacts/final_model%2fmodel.safetensors", {}),
            ("GET", f"datasets/..%2f{ds}", {}), ("GET", f"datasets/{ds}.jsonl", {})]


def test_bob_cannot_reach_alices_jobs_datasets_or_artifacts(world):
    attempts = targets(world)
    assert len(attempts) >= 12
    answers = [(m, p, api(world, "bob", m, p, **kw)) for m, p, kw in attempts]
    assert [(m, p, r.status_code) for m, p, r in answers if not refused(r)] == []
    assert all(r.status_code == 404 for m, p, r in answers if "%2f" not in p.lower())  # unknown, like a missing one
    assert api(world, "alice", "GET", f"jobs/{world.job}").json()["state"] == "succeeded"  # untouched
    assert api(world, "alice", "GET", f"datasets/{world.dataset}").status_code == 200


def test_bobs_lists_and_usage_show_nothing_of_alices(world):
    assert api(world, "bob", "GET", "jobs").json()["jobs"] == []
    assert api(world, "bob", "GET", "jobs", params={"state": "succeeded"}).json()["jobs"] == []
    assert api(world, "bob", "GET", "datasets").json()["datasets"] == []
    usage = api(world, "bob", "GET", "usage").json()
    assert usage["tenant"] == "bob" and usage["compute_seconds"] == 0 and usage["dataset_bytes"] == 0


# -- job specs: references to alice's objects, paths and modules ------------------------------------
PATHS = ["/etc/passwd", "../../../../etc/passwd", "..%2f..%2f..%2fetc%2fpasswd", "%2e%2e/%2e%2e/service.db",
         "file:///etc/passwd", "~/.ssh/id_rsa", "\\\\server\\share", "./rows.jsonl", "ds-0123456789abcdef/../x"]
MODULES = ["os:system", "builtins:exec", "subprocess:Popen", "importlib:import_module", "shutil:rmtree",
           "lockstep.service.app:create_app", "lockstep.service.scheduler:adopt_orphans", ".registry:make_suite",
           "..envs:x", "/tmp/evil:make", "evil.py:make", "os.path:join", "lockstep.envs.registry:resolve_factory"]


def spec_attacks(w) -> list[dict]:
    alice_run = w.home_jobs / w.job / "run"
    attacks = [{"model": {"path": f"job:{w.job}"}},
               {"model": {"path": str(alice_run / "final_model")}},  # the reproduced attack
               {"model": {"path": str(alice_run / "checkpoints" / "final")}},
               {"env": {"name": "math", "path": w.dataset}},
               {"env": {"name": "math", "path": "ds-0123456789abcdef", "test_path": w.dataset}},
               {"stages": [{"kind": "sft", "steps": 1, "dataset": w.dataset}]},
               {"env": {"name": "math", "path": str(w.dataset_file)}}]
    for p in [*PATHS, str(alice_run / "metrics.jsonl")]:
        attacks += [{"model": {"path": p}}, {"env": {"name": "math", "path": p}},
                    {"env": {"name": "math", "path": "ds-0123456789abcdef", "test_path": p}},
                    {"stages": [{"kind": "sft", "steps": 1, "dataset": p}]}]
    return attacks + [{"env": {"name": m}} for m in MODULES]


def test_every_path_like_field_of_a_spec_refuses_paths_modules_and_alices_objects(world):
    attacks = spec_attacks(world)
    answers = [(spec, api(world, "bob", "POST", "jobs", json={"spec": spec})) for spec in attacks]
    assert [(spec, r.status_code) for spec, r in answers if not refused(r)] == []
    assert all(r.status_code == 400 for _, r in answers)
    assert len(attacks) >= 60


def test_nothing_was_created(world):
    assert api(world, "bob", "GET", "jobs").json()["jobs"] == []
    assert api(world, "bob", "GET", "datasets").json()["datasets"] == []
    assert [j["id"] for j in api(world, "alice", "GET", "jobs").json()["jobs"]] == [world.job]
    assert sorted(p.name for p in world.home_jobs.iterdir()) == world.job_dirs  # no other job ever started
    assert sorted(p.name for p in (Path(world.storage) / "datasets").iterdir()) == sorted(
        {p.name for p in (Path(world.storage) / "jobs").iterdir()})  # alice's tenant dir only, in both
