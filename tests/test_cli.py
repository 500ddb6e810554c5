"""The CLI surface is frozen here so that flags do not sprawl: change this test on purpose."""

from lockstep.cli import build_parser


def _surface(parser, prefix=""):
    out = set()
    for action in parser._actions:
        if action.option_strings:
            out.add(prefix + "/".join(sorted(action.option_strings)))
        if getattr(action, "choices", None) and isinstance(action.choices, dict):
            for name, sub in action.choices.items():
                out |= _surface(sub, f"{prefix}{name} ")
    return out


def test_cli_surface_is_frozen():
    assert _surface(build_parser()) == {
        "--help/-h",
        "run --help/-h", "run --run-dir", "run --ray-address", "run --dry-run", "run --resume", "run --metrics-port",
        "run --alerts", "run --alert-webhook", "run --dashboard",
        "plan --help/-h", "plan --gpus", "plan --cpus", "plan --model-config", "plan --prompt-tokens", "plan --json",
        "plan --zero-variance",
        "trace --help/-h", "trace --output/-o", "dashboard --help/-h", "dashboard --port",
        "check --help/-h",
        "check consistency --help/-h", "check consistency --model", "check consistency --json",
        "check consistency --seed", "check consistency --max-tokens", "check consistency --speculative",
        "check consistency --draft-tokens", "check consistency --device", "check consistency --dtype",
        "check consistency --tenants",
        "serve --help/-h", "serve --host", "serve --port", "serve --db", "serve --storage", "serve --model",
        "serve --ray-address", "serve --no-worker", "serve --max-body-mb", "serve --job-slots", "serve --policy",
        "serve --alerts", "serve --alert-webhook",
        "worker --help/-h", "worker --db", "worker --storage", "worker --model", "worker --ray-address",
        "worker --persist-every", "worker --job-slots", "worker --policy",
        # the worker's bounds, on `worker` and on `serve` (for the worker it starts)
        *(f"{cmd} --{flag}" for cmd in ("serve", "worker") for flag in (
            "max-attempts", "max-models", "max-samplers", "fetch-cache-mb", "janitor-every", "session-ttl",
            "speculative", "draft-tokens", "device", "dtype", "job-memory", "model-cache-mb", "max-batch-tokens")),
        "serve --persist-every",
        "tenants --help/-h", "tenants create --help/-h", "tenants create --db", "tenants create --json",
        "tenants create --max-jobs", "tenants create --max-models",
        "tenants rotate-key --help/-h", "tenants rotate-key --db", "tenants rotate-key --json",
        "submit --help/-h", "submit --name", "submit --priority", "submit --max-attempts", "submit --server",
        "submit --api-key", "submit --json",
        "jobs --help/-h", "jobs --server", "jobs --api-key", "jobs --json",
        "logs --help/-h", "logs --follow/-f", "logs --server", "logs --api-key", "logs --json", "logs --output",
        "job --help/-h", "job --server", "job --api-key", "job --json",
        "cancel --help/-h", "cancel --server", "cancel --api-key", "cancel --json",
        "dataset --help/-h", "dataset --name", "dataset --server", "dataset --api-key", "dataset --json",
        "sandbox --help/-h", "sandbox run --help/-h", "sandbox run --json",
        "sandbox fusion --help/-h", "sandbox fusion --host", "sandbox fusion --port", "sandbox fusion --max-concurrency",
        *(f"sandbox run --{flag}" for flag in ("wall-s", "cpu-s", "memory-mb", "processes", "file-size-mb",
                                               "open-files", "output-kb", "tmpfs-mb")),
    }


def test_dry_run_prints_the_plan(capsys):
    import json

    from lockstep.cli import main

    assert main(["run", "--dry-run", "rl.max_staleness=0"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["stages"][1]["max_staleness"] == 0
    assert out["plan"]["stages"][1]["batches_in_flight"] == 1
    assert out["plan"]["trainer_threads"] >= 1


def test_bad_override_fails_before_any_work(capsys):
    from lockstep.cli import main

    assert main(["run", "rl.max_stalness=2"]) == 2
    assert "did you mean 'max_staleness'" in capsys.readouterr().err
    assert main(["run", "rl.loss=stable_reinforce", "--run-dir", "/nonexistent/never-created"]) == 2
    err = capsys.readouterr().err
    assert "stages[1].loss" in err and "importance_sampling" in err
