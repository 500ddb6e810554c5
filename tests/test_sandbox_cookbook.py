"""lockstep's sandbox as tinker-cookbook's SandboxInterface and as SandboxFusion's /run_code."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
from pathlib import Path

import pytest

from required import require_sandbox

pytest.importorskip("tinker_cookbook")


@pytest.fixture(autouse=True)
def _sandbox():
    require_sandbox()


def run(coro):
    return asyncio.run(coro)


async def _with_sandbox(body):
    from lockstep.sandbox.cookbook import LockstepSandbox

    sb = await LockstepSandbox.create()
    try:
        return await body(sb)
    finally:
        await sb.cleanup()


def test_it_is_the_cookbooks_sandbox_interface_and_runs_a_program():
    from tinker_cookbook.sandbox import SandboxInterface

    async def body(sb):
        assert isinstance(sb, SandboxInterface) and sb.sandbox_id.startswith("lockstep-")
        await sb.send_heartbeat()
        wrote = await sb.write_file("work/prog.py", "import sys\nprint(int(sys.stdin.readline() or 41) + 1)\n"
                                    "print('err', file=sys.stderr)\nsys.exit(3)\n")
        ran = await sb.run_command("python3 prog.py < /dev/null", workdir="/tmp/work")
        read = await sb.read_file("/tmp/work/prog.py", max_bytes=10)
        return wrote, ran, read

    wrote, ran, read = run(_with_sandbox(body))
    assert wrote.exit_code == 0
    assert (ran.exit_code, ran.stdout, ran.stderr) == (3, "42\n", "err\n")
    assert read.exit_code == 0 and read.stdout == "import sys"


def test_timeouts_and_output_caps_hold_and_the_sandbox_survives_them():
    async def body(sb):
        slow = await sb.run_command("sleep 30", timeout=1)
        loud = await sb.run_command("yes | head -c 1000000", max_output_bytes=100)
        after = await sb.run_command("echo alive")
        return slow, loud, after

    slow, loud, after = run(_with_sandbox(body))
    assert slow.exit_code == 124 and slow.metrics["timed_out"]
    assert len(loud.stdout) == 100 and loud.metrics["truncated"]
    assert after.stdout == "alive\n"


def test_bad_arguments_get_errors_that_name_them():
    async def body(sb):
        errors = []
        for call in (sb.run_command(""), sb.run_command("true", timeout=0), sb.run_command("true", max_output_bytes=-1),
                     sb.read_file("x", max_bytes=1 << 40), sb.write_file("x", 5)):
            with pytest.raises(ValueError) as e:
                await call
            errors.append(str(e.value))
        return errors

    errors = run(_with_sandbox(body))
    for needle, msg in zip(("command", "timeout", "max_output_bytes", "max_bytes", "content"), errors):
        assert needle in msg, msg


def test_a_cleaned_up_sandbox_raises_the_cookbooks_terminated_error():
    from tinker_cookbook.sandbox import SandboxTerminatedError

    from lockstep.sandbox.cookbook import LockstepSandbox

    async def body():
        sb = await LockstepSandbox.create()
        await sb.cleanup()
        with pytest.raises(SandboxTerminatedError):
            await sb.run_command("true")

    run(body())


def test_the_host_is_out_of_reach(tmp_path):
    """A secret on the host, readable by this process: an unsandboxed shell reads it (the
    control), the sandbox's command and read_file cannot read it, write_file cannot replace it
    (the same path inside is the sandbox's own private /tmp), and the system is read-only."""
    secret = tmp_path / "secret.txt"
    secret.write_text("host-secret")
    control = subprocess.run(["/bin/sh", "-c", f"cat {secret}"], capture_output=True, text=True)
    assert control.stdout == "host-secret"

    async def body(sb):
        return (await sb.run_command(f"cat {secret}"), await sb.read_file(str(secret)),
                await sb.write_file(str(secret), "overwritten"), await sb.run_command("echo x > /etc/lockstep-x"))

    cat, read, write, etc = run(_with_sandbox(body))
    assert cat.exit_code != 0 and "host-secret" not in cat.stdout
    assert read.exit_code != 0 and etc.exit_code != 0
    assert secret.read_text() == "host-secret" and not Path("/etc/lockstep-x").exists()


def test_the_environment_carries_no_host_secrets(monkeypatch):
    monkeypatch.setenv("TINKER_API_KEY", "tml-secret-key")

    async def body(sb):
        return await sb.run_command("env")

    out = run(_with_sandbox(body))
    assert out.exit_code == 0 and "tml-secret-key" not in out.stdout and "TINKER" not in out.stdout
    assert os.environ["TINKER_API_KEY"] == "tml-secret-key"  # the control: this process has it


# --- SandboxFusion's /run_code, which code_rl's default backend calls -----------------------------

@pytest.fixture(scope="module")
def fusion():
    from fastapi.testclient import TestClient

    from lockstep.sandbox.cookbook import fusion_app

    with TestClient(fusion_app()) as client:
        yield client


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def test_code_rl_grading_runs_on_lockstep(fusion, monkeypatch):
    """code_rl's own grader (its SandboxFusionClient, default backend) against lockstep's route:
    a right solution passes, a wrong one and a hostile one fail."""
    import tinker_cookbook.recipes.code_rl.code_grading as grading
    from tinker_cookbook.sandbox import SandboxFusionClient

    class Client(SandboxFusionClient):  # the recipe's client over the test app instead of a socket
        async def run(self, code, files, timeout, language="python"):
            payload = {"code": code, "language": language, "run_timeout": int(timeout),
                       "files": {k: b64(v) for k, v in files.items()}}
            resp = await asyncio.to_thread(fusion.post, "/run_code", json=payload)
            data = resp.json()
            return data.get("status") == "Success", data

    monkeypatch.setattr(grading, "_sandboxfusion_client", Client(url="http://unused"))
    tests = [{"input": f"{x}\n", "output": f"{x + 5}\n", "testtype": "stdin_stdout", "metadata": {}} for x in (1, 7)]
    right = run(grading.sandbox_check_correctness(tests, "print(int(input()) + 5)"))
    wrong = run(grading.sandbox_check_correctness(tests, "print(int(input()) + 4)"))
    hostile = run(grading.sandbox_check_correctness(tests, "import os\nprint(open('/etc/shadow').read())"))
    assert right[0] is True, right
    assert wrong[0] is False and hostile[0] is False


def test_run_code_answers_like_sandboxfusion(fusion):
    ok = fusion.post("/run_code", json={"code": "print(open('data.txt').read())", "language": "python",
                                        "run_timeout": 10, "files": {"data.txt": b64("hello")}}).json()
    bad = fusion.post("/run_code", json={"code": "raise SystemExit(2)", "run_timeout": 10}).json()
    assert ok["status"] == "Success" and ok["run_result"]["stdout"] == "hello\n"
    assert bad["status"] == "Failed" and bad["run_result"]["return_code"] == 2


@pytest.mark.parametrize("body,field", [
    ({"code": "print(1)", "language": "cpp"}, "language"),
    ({"code": 5}, "code"),
    ({"code": "1", "run_timeout": 1e9}, "run_timeout"),
    ({"code": "1", "files": {"../../etc/x": b64("x")}}, "files"),
    ({"code": "1", "files": {"/abs": b64("x")}}, "files"),
    ({"code": "1", "files": {"a.txt": "not base64!"}}, "files"),
    ([1, 2], "body"),
])
def test_run_code_refuses_bad_requests_with_a_400_naming_the_field(fusion, body, field):
    resp = fusion.post("/run_code", content=json.dumps(body), headers={"content-type": "application/json"})
    assert resp.status_code == 400 and field in resp.json()["detail"], resp.text
