"""`lockstep run` end to end on Ray: sync and async runs, multi-turn and math envs, crashed
components replayed, and SIGKILL + `--resume` checked against the exactly-once ledger."""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import ray
from safetensors.numpy import load_file

from lockstep.config import load
from lockstep.runtime.ledger import audit
from lockstep.runtime.run import actor_name, latest_checkpoint, run

TINY = ["stages.0.steps=6", "stages.0.batch_size=16", "stages.0.eval_every=3", "stages.0.target_accuracy=0.0",
        "rl.steps=4", "rl.prompts_per_step=4", "rl.group_size=4", "rl.eval_every=2", "rl.max_seconds=0",
        "rl.learning_rate=3e-4", "env.num_heldout=20", "env.pass_k=4", "runtime.checkpoint_every=5"]

CRASH = ["stages.0.steps=4", "stages.0.batch_size=16", "stages.0.eval_every=100", "stages.0.target_accuracy=0.0",
         "rl.steps=10", "rl.prompts_per_step=4", "rl.group_size=4", "rl.eval_every=100", "rl.max_seconds=0",
         "rl.max_staleness=0", "env.num_heldout=8", "env.pass_k=0", "runtime.checkpoint_every=3", "seed=3"]


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    yield
    ray.shutdown()


def records(d):
    return [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]


def check_ledger(d, rl_steps, prompts_per_step):
    """Every RL group the run trained, it trained once; each step trained a full batch; nothing
    is left pending; and the audit of the log agrees with the committed final ledger."""
    led = audit(d / "ledger.jsonl")
    assert led.pending() == []
    steps = sorted(led.trained_step.values())
    assert steps == sorted(s for s in range(1, rl_steps + 1) for _ in range(prompts_per_step))
    final = json.loads((d / "checkpoints" / "final" / "meta.json").read_text())["data_position"]["ledger"]
    assert final["trained"] == led.trained_step and final["pending"] == []
    return led


@pytest.mark.parametrize("staleness", [0, 2])
def test_run_writes_a_complete_run_directory(tmp_path, builtin_dir, staleness):
    spec = load(None, [*TINY, f"model.path='{builtin_dir}'", f"rl.max_staleness={staleness}"])
    summary = run(spec, tmp_path / "run")
    d = tmp_path / "run"
    for name in ("config.json", "metrics.jsonl", "summary.json", "report.html", "ledger.jsonl"):
        assert (d / name).is_file(), name
    assert (d / "final_model" / "config.json").is_file() and (d / "final_model" / "model.safetensors").is_file()
    assert (d / "checkpoints" / "step-000005" / "MANIFEST.json").is_file()
    assert json.loads((d / "config.json").read_text())["stages"][1]["max_staleness"] == staleness
    for key in ("eval_accuracy_start", "eval_accuracy_after_sft", "eval_accuracy_final", "wall_seconds", "steps",
                "eval_pass@4_final"):
        assert key in summary
    assert summary["steps"] == 10
    rl = [r for r in records(d) if "rollout/reward_mean" in r]
    assert len(rl) == 4
    assert all(0 <= r["rollout/staleness_max"] <= staleness for r in rl)  # the bound holds
    for key in ("filter/zero_variance", "filter/truncated", "filter/stale", "filter/repetitive", "env/failed_groups",
                "time/step_s", "train/entropy", "throughput/samples_per_s", "throughput/sampled_tokens_per_s",
                "mismatch/abs", "mismatch/k3_kl", "mismatch/ess", "queue/in_flight_batches", "queue/replay_groups"):
        assert key in rl[0], key
    assert all(r["train/entropy"] > 0 for r in rl)
    evals = [r for r in records(d) if "eval/accuracy" in r]
    assert evals and any("eval/pass@4" in r for r in evals)
    for r in rl:  # the staleness histogram covers every trained sample, within the bound
        hist = {int(k.split("/")[1]): v for k, v in r.items() if k.startswith("staleness/")}
        assert sum(hist.values()) == 4 * 4 and max(hist) <= staleness and min(hist) >= 0
        assert r["queue/in_flight_batches"] <= staleness + 1 and r["queue/buffered_groups"] >= 0
    if staleness == 0:  # on-policy: the trainer recomputes exactly the sampler's logprobs
        assert all(r["mismatch/abs"] == 0.0 and r["mismatch/ess"] == 1.0 for r in rl)
    page = (d / "report.html").read_text()
    assert "<img" in page and "Per-stage throughput" in page
    assert [r["stage"] for r in summary["stages"]] == ["sft", "rl"] and summary["stages"][1]["steps"] == 4
    check_ledger(d, 4, 4)


def test_multi_turn_episodes_run_in_the_loop(tmp_path, builtin_dir):
    spec = load(None, [*TINY, f"model.path='{builtin_dir}'", "env.max_turns=2", "rl.max_staleness=1"])
    run(spec, tmp_path / "run")
    rl = [r for r in records(tmp_path / "run") if "rollout/reward_mean" in r]
    assert len(rl) == 4 and all(r["mismatch/abs"] >= 0 for r in rl)
    check_ledger(tmp_path / "run", 4, 4)


def test_math_env_grades_with_math_verify_inside_ray(tmp_path, builtin_dir):
    rows = [{"problem": f"{a}+{b}", "answer": str(a + b)} for a in range(10) for b in range(4)]
    rows.append({"problem": "no answer here"})  # counted and skipped
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sft = tmp_path / "sft.jsonl"
    sft.write_text("".join(json.dumps({"prompt": f"{a}+1\nAnswer: ", "completion": str(a + 1)}) + "\n" for a in range(20)))
    spec = load(None, [*TINY, f"model.path='{builtin_dir}'", "env.name=math", f"env.path='{data}'", "env.num_heldout=8",
                       f"stages.0.dataset='{sft}'"])
    summary = run(spec, tmp_path / "run")
    assert summary["data"][str(data)] == {"rows": 41, "skipped": 1}
    assert summary["data"][str(sft)] == {"rows": 20, "skipped": 0}
    rl = [r for r in records(tmp_path / "run") if "rollout/reward_mean" in r]
    assert len(rl) == 4 and all(r["env/failed_groups"] == 0 for r in rl)  # grading ran, in a pool


@pytest.fixture(scope="module")
def reference(tmp_path_factory, builtin_dir):
    """An uninterrupted synchronous run: a resumed or recovered run must end bit for bit here."""
    d = tmp_path_factory.mktemp("reference") / "run"
    run(load(None, [*CRASH, f"model.path='{builtin_dir}'"]), d)
    return load_file(str(d / "checkpoints" / "final" / "model.safetensors"))


def assert_same_weights(d, reference):
    final = load_file(str(d / "checkpoints" / "final" / "model.safetensors"))
    assert final.keys() == reference.keys()
    assert all((final[k] == reference[k]).all() for k in final)


def run_and_kill(tmp_path, builtin_dir, role, after_rl_steps):
    """Run in a thread; once `after_rl_steps` RL steps are logged, kill one actor (Ray restarts it)."""
    d = tmp_path / "run"
    spec = load(None, [*CRASH, f"model.path='{builtin_dir}'"])
    out = {}
    thread = threading.Thread(target=lambda: out.update(summary=run(spec, d)))
    thread.start()
    deadline = time.time() + 120
    while time.time() < deadline and not out:
        if (d / "metrics.jsonl").exists() and sum("rollout/reward_mean" in r for r in records(d)) >= after_rl_steps:
            ray.kill(ray.get_actor(actor_name(d, role)), no_restart=False)
            break
        time.sleep(0.05)
    thread.join(timeout=300)
    assert "summary" in out, "the run did not finish after the crash"
    return d, out["summary"]


@pytest.mark.parametrize("role", ["generator", "env0"])
def test_a_crashed_generator_or_env_worker_is_restarted_and_its_groups_replayed(tmp_path, builtin_dir, reference, role):
    d, summary = run_and_kill(tmp_path, builtin_dir, role, after_rl_steps=4)
    assert summary["counters"]["runtime/restarts"] >= 1
    led = check_ledger(d, 10, 4)
    log = [json.loads(line) for line in (d / "ledger.jsonl").read_text().splitlines()]
    assert any(e["event"] == "requeued" and e["reason"] == "component_restart" for e in log)
    assert max(led.attempts.values()) >= 2
    assert_same_weights(d, reference)  # the replay changed nothing: the run is the same run


def test_a_crashed_trainer_resumes_from_its_last_checkpoint(tmp_path, builtin_dir, reference):
    d, summary = run_and_kill(tmp_path, builtin_dir, "trainer", after_rl_steps=5)
    assert summary["counters"]["runtime/resumes"] == 1
    check_ledger(d, 10, 4)
    assert_same_weights(d, reference)


def cli(*args, **kw):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen([sys.executable, "-m", "lockstep.cli", "run", *args], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, **kw)


@pytest.mark.parametrize("staleness", [0, 2])
def test_sigkill_then_resume_trains_every_group_exactly_once(tmp_path, builtin_dir, reference, staleness):
    d = tmp_path / "run"
    args = [*CRASH, f"model.path='{builtin_dir}'", f"rl.max_staleness={staleness}", "--run-dir", str(d)]
    proc = cli(*args)
    deadline = time.time() + 180
    while time.time() < deadline:  # kill mid-RL, after a checkpoint and before the end
        if (d / "metrics.jsonl").exists() and sum("rollout/reward_mean" in r for r in records(d)) >= 5:
            break
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (d / "checkpoints" / "final").exists()
    assert latest_checkpoint(d) is not None
    resumed = cli("--resume", str(d))
    assert resumed.wait(timeout=300) == 0, resumed.stderr.read().decode()[-2000:]
    summary = json.loads((d / "summary.json").read_text())
    assert summary["counters"]["runtime/resumes"] == 1 and summary["steps"] == 14
    log = [json.loads(line) for line in (d / "ledger.jsonl").read_text().splitlines()]
    # The newest checkpoint by the kill: 4 SFT + 2 or 5 RL steps, by how far the trainer's last
    # save had got (an orphaned trainer may finish it after the driver died).
    assert [e["name"] for e in log if e["event"] == "resume"] in (["step-000006"], ["step-000009"])
    check_ledger(d, 10, 4)
    steps = [r["step"] for r in records(d) if "train/loss_sum" in r]
    assert steps == list(range(1, 15))  # replayed steps overwrite their metrics, never duplicate them
    if staleness == 0:
        assert_same_weights(d, reference)
