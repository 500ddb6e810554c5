"""The `lockstep` command: a thin layer over the library (run | plan | check | ...)."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path


def _cmd_check_consistency(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from lockstep.engine import consistency
    from lockstep.engine.tiny import ensure_tiny_model

    model_dir = args.model or str(ensure_tiny_model())
    from lockstep.engine.device import Compute

    if args.tenants is not None:
        return _check_tenants(args, model_dir, Compute(args.device, args.dtype))
    report = consistency.run(model_dir, seed=args.seed, max_tokens=args.max_tokens, speculative=args.speculative,
                             draft_tokens=args.draft_tokens, compute=Compute(args.device, args.dtype))
    console = Console(stderr=args.json)
    table = Table(title=f"sampler vs trainer logprobs — {model_dir}")
    for col in ("path", "lora", "batch", "threads (sampler, trainer)", "tokens", "bitwise equal", "max |Δlogp|"):
        table.add_column(col)
    for name, cases in ((f"lockstep ({report['path']})", report["cases"]), ("transformers", report["hf"]["cases"])):
        for c in cases:
            threads = "{}, {}".format(*c["threads"]) if "threads" in c else "-"
            table.add_row(name, str(c["lora"]), str(c["batch"]), threads, str(c["tokens"]), str(c["equal"]),
                          f"{c['max_abs_diff']:.3g}")
    console.print(table)
    ok = report["tokens_bitwise_equal"] == report["tokens_compared"]
    console.print(
        f"lockstep ({report['path']} forward: {report['path_reason']}): "
        f"{report['tokens_bitwise_equal']}/{report['tokens_compared']} tokens bitwise equal; "
        f"transformers: {report['hf']['tokens_bitwise_equal']}/{report['hf']['tokens_compared']}, "
        f"max |Δlogp| {report['hf']['max_abs_diff']:.3g}"
    )
    if report["speculative"]["drafter"] != "off":
        sp = report["speculative"]
        console.print(f"speculative decoding ({sp['drafter']} drafter, up to {sp['draft_tokens']} a step): "
                      f"{sp['accepted']} of {sp['drafted']} drafted tokens accepted")
    if report["moe"]:
        ok = ok and report["routing_equal"] == report["routing_compared"]
        console.print(f"lockstep: {report['routing_equal']}/{report['routing_compared']} expert choices equal "
                      f"(sampler decode against trainer forward, every MoE layer)")
    if args.json:
        print(json.dumps(report))
    return 0 if ok else 1


def _check_tenants(args, model_dir: str, compute) -> int:
    """`check consistency --tenants K`: K adapters packed against alone (engine/consistency.run_tenants)."""
    from rich.console import Console
    from rich.table import Table

    from lockstep.engine import consistency

    report = consistency.run_tenants(model_dir, tenants=args.tenants, seed=args.seed, max_tokens=args.max_tokens,
                                     speculative=args.speculative, draft_tokens=args.draft_tokens, compute=compute)
    console = Console(stderr=args.json)
    table = Table(title=f"{args.tenants} LoRA tenants packed vs alone ({report['path']} path) — {model_dir}")
    for col in ("part", "what", "compared", "bitwise equal"):
        table.add_column(col)
    table.add_row("sampler", "tokens and logprobs", str(report["sampler"]["tokens_compared"]),
                  str(report["sampler"]["tokens_bitwise_equal"]))
    for kind, counts in report["trainer"].items():
        for what, c in counts.items():
            table.add_row(f"trainer {kind}", what, str(c["compared"]), str(c["equal"]))
    vs = report["sampler_vs_trainer"]
    table.add_row("sampler vs packed trainer", "logprobs", str(vs["tokens_compared"]), str(vs["tokens_bitwise_equal"]))
    console.print(table)
    console.print("adapters: " + "; ".join(f"rank {a['rank']} on {','.join(a['targets'])} ({a['loss']})"
                                           for a in report["adapters"]) + " and rows on the bare base")
    if report["speculative"]["drafter"] != "off":
        sp = report["speculative"]
        console.print(f"speculative decoding ({sp['drafter']}): {sp['accepted']} of {sp['drafted']} drafts accepted")
    console.print("every count equal" if report["ok"] else "MISMATCH: packed results differ from alone")
    if args.json:
        print(json.dumps(report))
    return 0 if report["ok"] else 1


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


PREEMPTED_EXIT = 75
"""Exit status of a run stopped by SIGTERM after checkpointing (EX_TEMPFAIL); the job service
requeues such a job and resumes it later."""


DASHBOARD_PORT = 8600


def _load_spec(args):
    import dataclasses

    from lockstep.config import ConfigError, load

    if args.resume:
        if args.config:
            raise ConfigError("--resume continues a run with its own config.json; drop the config file (overrides "
                              "of where it runs, e.g. train.replicas=4, are accepted)")
        path = Path(args.resume) / "config.json"
        if not path.is_file():
            raise ConfigError(f"--resume {args.resume}: no config.json there (is it a run directory?)")
        from lockstep.config import from_dict, rescale

        spec = rescale(from_dict(json.loads(path.read_text())), args.overrides)
    else:
        spec = load(args.config, args.overrides)
    if args.ray_address:
        spec = dataclasses.replace(spec, runtime=dataclasses.replace(spec.runtime, ray_address=args.ray_address))
    return spec


def _exit_with_supervisor() -> None:
    """Under the job service ($LOCKSTEP_SUPERVISOR_PID set by its scheduler): end this run's
    process group as soon as the worker that started it is gone. By polling the parent rather than
    PR_SET_PDEATHSIG, which fires when the forking *thread* ends and is Linux-only."""
    import os
    import signal
    import threading
    import time

    from lockstep.service.scheduler import SUPERVISOR_ENV

    supervisor = os.environ.get(SUPERVISOR_ENV, "")
    if not supervisor.isdigit():
        return

    def watch():
        while os.getppid() == int(supervisor):
            time.sleep(0.25)
        os.killpg(os.getpgrp(), signal.SIGKILL)

    threading.Thread(target=watch, daemon=True, name="supervisor-watchdog").start()


def _serve_metrics(run_dir: Path, port: int) -> None:
    from lockstep.config import ConfigError
    from lockstep.monitor.prometheus import serve_run_metrics

    _check_port(port, "--metrics-port")
    try:
        serve_run_metrics(run_dir, port)
    except OSError as e:
        raise ConfigError(f"--metrics-port {port}: cannot listen there ({e.strerror or e}); pick another port") from None


def _cmd_run(args) -> int:
    import time

    _exit_with_supervisor()
    from rich.console import Console

    from lockstep.runtime.plan import make_plan
    from lockstep.runtime.run import check_losses

    spec = _load_spec(args)
    check_losses(spec)
    plan = make_plan(spec)
    console = Console()
    if args.dry_run:
        from lockstep.config import to_dict
        from lockstep.planner import PlanRefused

        try:
            strategy = _dry_run_strategy(spec)
        except PlanRefused as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(json.dumps({"config": to_dict(spec), "plan": plan.as_dict(), "strategy": strategy}, indent=2))
        return 0
    from lockstep.runtime.rundir import check_writer

    run_dir = args.resume or args.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}"
    check_writer(Path(run_dir))  # a live run's directory: refused before anything starts (exit 2)
    console.print(f"[bold]lockstep run[/bold] -> {run_dir}" + (" (resuming)" if args.resume else ""))
    with contextlib.ExitStack() as held:
        if args.alerts or args.alert_webhook:  # alerts.jsonl is written from here on: the run's lock first
            from lockstep.runtime.rundir import writer_lock

            held.enter_context(writer_lock(Path(run_dir)))
        return _run_in(args, spec, console, run_dir)


def _run_in(args, spec, console, run_dir: str) -> int:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from lockstep.runtime.run import run

    if args.metrics_port is not None:
        _serve_metrics(Path(run_dir), args.metrics_port)
        console.print(f"Prometheus metrics: http://127.0.0.1:{args.metrics_port}/metrics")
    if args.dashboard is not None:
        from lockstep.monitor import dashboard

        _check_port(args.dashboard, "--dashboard")
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        dashboard.serve(Path(run_dir), args.dashboard, background=True, single=True)
        console.print(f"dashboard: http://127.0.0.1:{args.dashboard}/")
    if args.alerts or args.alert_webhook:
        from lockstep.monitor import alerts

        rules = alerts.load_rules(args.alerts)
        alerts.watch(Path(run_dir), rules, alerts.Webhook(args.alert_webhook) if args.alert_webhook else None)
        console.print(f"alerts: {len(rules)} rules -> {run_dir}/alerts.jsonl"
                      + (f" and {args.alert_webhook}" if args.alert_webhook else ""))
    total = sum(s.steps for s in spec.stages)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
                  TimeElapsedColumn(), console=console, transient=False) as bar:
        task = bar.add_task("starting", total=total, info="")

        def progress(step, what, acc, reward=None):
            info = f"acc {acc:.2f}" + (f"  reward {reward:.2f}" if reward is not None else "")
            bar.update(task, completed=step, description=what, info=info)

        from lockstep.runtime.run import Preempted

        try:  # SIGTERM: checkpoint at the next step, then stop (the job service preempts this way)
            summary = run(spec, Path(run_dir), progress, resume=bool(args.resume), preemptible=True)
        except Preempted as e:
            console.print(f"preempted: {e}; continue with lockstep run --resume {run_dir}")
            return PREEMPTED_EXIT
    console.print(
        f"accuracy: start {summary['eval_accuracy_start']:.2f} -> after SFT {summary['eval_accuracy_after_sft']:.2f}"
        f" -> final {summary['eval_accuracy_final']:.2f} in {summary['wall_seconds']:.0f}s; "
        f"report: {run_dir}/report.html"
    )
    return 0


def _dry_run_strategy(spec) -> dict:
    """The planner's strategy for this machine; a config whose counts cannot fit raises PlanRefused.
    Where the planner lacks an input (a data-dependent prompt length, a model it cannot read) the
    strategy says so rather than failing a dry run that used to pass."""
    from lockstep.planner import GPUS, PlanRefused, plan_run
    from lockstep.planner.report import as_json
    from lockstep.planner.shapes import spec_workload

    if spec.model.device == "cuda":  # this machine's planner calibrates its CPU, which a GPU run does not use
        return {"skipped": "the strategy of a model.device = 'cuda' run: `lockstep plan [CONFIG] --gpus KIND:COUNT` "
                           f"(kinds: {', '.join(GPUS)}) plans it for that GPU kind"}
    try:
        work = spec_workload(spec)
        strategy = plan_run(spec)
    except PlanRefused as e:
        if e.resource in ("workload", "model"):
            return {"skipped": str(e)}
        raise
    return as_json(strategy, work)


def _cmd_plan(args) -> int:
    from dataclasses import replace

    from rich.console import Console

    from lockstep.config import load
    from lockstep.planner import PlanRefused, cpu_cluster, parse_gpus, plan_run
    from lockstep.planner.report import as_json, table
    from lockstep.planner.shapes import spec_workload

    spec = load(args.config, args.overrides)
    try:
        if args.gpus and args.cpus:
            raise PlanRefused("devices", "pass --gpus KIND:COUNT or --cpus N, not both")
        cluster = parse_gpus(args.gpus) if args.gpus else cpu_cluster(args.cpus) if args.cpus is not None else None
        if not 0.0 <= args.zero_variance < 1.0:
            raise PlanRefused("workload", f"--zero-variance {args.zero_variance}: expected a share in [0, 1)")
        work = replace(spec_workload(spec, prompt=args.prompt_tokens), zero_variance=args.zero_variance)
        strategy = plan_run(spec, cluster, model_config=args.model_config, workload=work)
    except PlanRefused as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(as_json(strategy, work), indent=2))
    else:
        Console().print(table(strategy, work))
    return 0


def _load_policy(path: str | None):
    """The operator's job policy (service/policy.py), also handed to the worker's scheduler via
    $LOCKSTEP_POLICY; without --policy, the safe defaults."""
    import os

    from lockstep.service.policy import POLICY_ENV, Policy, PolicyError

    if not path:
        os.environ.pop(POLICY_ENV, None)
        return Policy()
    try:
        policy = Policy.load(path)
    except PolicyError as e:
        raise SystemExit(f"error: --policy: {e}") from None
    os.environ[POLICY_ENV] = str(Path(path).resolve())
    return policy


def _cmd_dashboard(args) -> int:
    from lockstep.config import ConfigError
    from lockstep.monitor import dashboard

    if not Path(args.run_dir).is_dir():
        raise ConfigError(f"{args.run_dir}: no such run directory")
    _check_port(args.port, "--port")
    print(f"lockstep dashboard: http://127.0.0.1:{args.port}/ ({args.run_dir}); Ctrl-C stops it")
    dashboard.serve(Path(args.run_dir), args.port)
    return 0


def _check_port(port: int, flag: str) -> None:
    import socket

    from lockstep.config import ConfigError

    if not 1 <= port <= 65535:
        raise ConfigError(f"{flag} {port}: expected a TCP port in [1, 65535]")
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server will: a TIME_WAIT port is free
        try:
            s.bind(("127.0.0.1", port))
        except OSError as e:
            raise ConfigError(f"{flag} {port}: cannot listen there ({e.strerror or e}); pick another port") from None


def _cmd_trace(args) -> int:
    from lockstep.config import ConfigError
    from lockstep.monitor.trace import chrome_trace, read_spans

    path = Path(args.run_dir) / "trace.jsonl"
    if not path.is_file():
        raise ConfigError(f"{args.run_dir}: no trace.jsonl there (is it a run directory? runs write it as they go)")
    trace = chrome_trace(read_spans(path), f"lockstep run {Path(args.run_dir).name}")
    Path(args.output).write_text(json.dumps(trace))
    print(f"{trace['otherData']['spans']} spans -> {args.output} (open it in https://ui.perfetto.dev or chrome://tracing)")
    return 0


def _cmd_serve(args) -> int:
    from lockstep.service.serve import default_db, default_storage, parse_models, run_api, worker_argv

    policy = _load_policy(args.policy)
    if args.alerts or args.alert_webhook:  # a malformed rule file fails here, before anything starts
        from lockstep.monitor import alerts

        alerts.load_rules(args.alerts, default=alerts.SERVICE_RULES)
        if args.alert_webhook:
            alerts.Webhook(args.alert_webhook)
    worker = None if args.no_worker else [*(f"--model={m}" for m in args.model or ()), *worker_argv(args),
                                          *(["--policy", str(Path(args.policy).resolve())] if args.policy else [])]
    parse_models(args.model)
    return run_api(host=args.host, port=args.port, db=args.db or default_db(), storage=args.storage or default_storage(),
                   max_body_mb=args.max_body_mb, worker_args=worker, policy=policy, alert_rules=args.alerts,
                   alert_webhook=args.alert_webhook)


def _cmd_worker(args) -> int:
    from lockstep.service.serve import default_db, default_storage, parse_models, run_worker, worker_options

    _load_policy(args.policy)
    return run_worker(db=args.db or default_db(), storage=args.storage or default_storage(),
                      models=parse_models(args.model), **worker_options(args))


def _cmd_tenants_create(args) -> int:
    from lockstep.service.db import connect
    from lockstep.service.serve import default_db
    from lockstep.service.tenants import create_tenant
    from lockstep.service.types import ServiceError

    _, sessions = connect(args.db or default_db())
    with sessions() as s:
        try:
            tenant, key = create_tenant(s, args.name, max_concurrent_jobs=args.max_jobs, max_models=args.max_models)
        except ServiceError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps({"tenant": tenant.name, "api_key": key}))
    else:
        print(f"tenant {tenant.name} created; its API key (shown only now):\n{key}")
    return 0


def _cmd_tenants_rotate(args) -> int:
    from lockstep.service.db import connect
    from lockstep.service.serve import default_db
    from lockstep.service.tenants import rotate_key
    from lockstep.service.types import ServiceError

    _, sessions = connect(args.db or default_db())
    with sessions() as s:
        try:
            key = rotate_key(s, args.name)
        except ServiceError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    print(json.dumps({"tenant": args.name, "api_key": key}) if args.json else
          f"tenant {args.name}'s new API key (shown only now; the old one no longer works):\n{key}")
    return 0


def _server(args):
    """(base URL, headers) of the job service a client command talks to."""
    import os

    base = (args.server or os.environ.get("LOCKSTEP_SERVER") or "http://127.0.0.1:8000").rstrip("/")
    key = args.api_key or os.environ.get("LOCKSTEP_API_KEY") or os.environ.get("TINKER_API_KEY")
    if not key:
        raise SystemExit("error: no API key: pass --api-key or set LOCKSTEP_API_KEY (see `lockstep tenants create`)")
    return base, {"Authorization": f"Bearer {key}"}


def _http(method: str, url: str, headers: dict, **kw):
    import httpx

    try:
        r = httpx.request(method, url, headers=headers, timeout=kw.pop("timeout", 30), **kw)
    except httpx.HTTPError as e:
        raise SystemExit(f"error: cannot reach {url}: {e}") from None
    if r.status_code >= 400:
        try:
            msg = r.json().get("error", r.text)
        except ValueError:
            msg = r.text
        raise SystemExit(f"error: {r.status_code}: {msg}")
    return r


def _cmd_submit(args) -> int:
    from lockstep.config import load, to_dict

    spec = load(args.config, args.overrides)
    base, headers = _server(args)
    body = {"spec": to_dict(spec), "name": args.name or (Path(args.config).stem if args.config else "default"),
            "priority": args.priority, "max_attempts": args.max_attempts}
    job = _http("POST", f"{base}/v1/jobs", headers, json=body).json()
    print(json.dumps(job) if args.json else f"submitted job {job['id']} ({job['priority']}); follow it with "
                                              f"`lockstep logs {job['id']} -f`")
    return 0


def _job_url(base: str, job: str, tail: str = "") -> str:
    """A job's URL; `job` is a whole id or any unique prefix of one (the server resolves it)."""
    from urllib.parse import quote

    return f"{base}/v1/jobs/{quote(job, safe='')}{tail}"


def _cmd_jobs(args) -> int:
    from rich import box
    from rich.console import Console
    from rich.table import Table

    base, headers = _server(args)
    jobs = _http("GET", f"{base}/v1/jobs", headers).json()["jobs"]
    if args.json:
        print(json.dumps(jobs))
        return 0
    # Fits 80 columns with whole ids (what `lockstep logs ID` takes; any unique prefix works too).
    table = Table(title="jobs", box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    table.add_column("id", no_wrap=True, min_width=16)
    table.add_column("name", overflow="fold")
    for col in ("state", "priority", "tries", "accuracy", "created (UTC)"):
        table.add_column(col, no_wrap=True)
    for j in jobs:
        acc = (j.get("summary") or {}).get("eval_accuracy_final")
        table.add_row(j["id"], j["name"], j["state"], j["priority"], str(j["attempts"]),
                      "" if acc is None else f"{acc:.3f}", j["created_at"][5:16].replace("T", " "))
    Console().print(table)
    return 0


def _cmd_job(args) -> int:
    base, headers = _server(args)
    job = _http("GET", _job_url(base, args.job), headers).json()
    if args.json:
        print(json.dumps(job))
        return 0
    acc = (job.get("summary") or {}).get("eval_accuracy_final")
    for key in ("id", "name", "state", "priority", "attempts", "max_attempts", "preemptions", "interruptions",
                "run_seconds", "created_at", "started_at", "finished_at"):
        print(f"{key:>14}: {job[key]}")
    if acc is not None:
        print(f"{'accuracy':>14}: {acc:.3f}")
    if job["error"]:
        print(f"{'error':>14}: {job['error']}\n{'':>16}(the whole output: lockstep logs {job['id']} --output)")
    return 0


def _cmd_cancel(args) -> int:
    base, headers = _server(args)
    job = _http("POST", _job_url(base, args.job, "/cancel"), headers).json()
    print(json.dumps(job) if args.json else f"job {job['id']}: {job['state']}")
    return 0


def _cmd_dataset(args) -> int:
    from urllib.parse import quote

    if args.action != "list" and not args.file:
        raise SystemExit(f"error: dataset {args.action} needs " + ("a file" if args.action == "upload" else "an id"))
    base, headers = _server(args)
    if args.action == "upload":
        path = Path(args.file)
        if not path.is_file():
            raise SystemExit(f"error: {path} is not a file")
        with open(path, "rb") as f:
            ds = _http("POST", f"{base}/v1/datasets", headers, params={"name": args.name or path.name}, content=f,
                       timeout=600).json()
        print(json.dumps(ds) if args.json else f"uploaded {path} as dataset {ds['id']} ({ds['num_rows']} rows); "
                                               f"use it as env.path = \"{ds['id']}\" (or env.test_path, stages[].dataset)")
    elif args.action == "delete":
        _http("DELETE", f"{base}/v1/datasets/{quote(args.file or '', safe='')}", headers)
        print(f"deleted dataset {args.file}")
    else:
        sets = _http("GET", f"{base}/v1/datasets", headers).json()["datasets"]
        if args.json:
            print(json.dumps(sets))
        for ds in [] if args.json else sets:
            print(f"{ds['id']}  {ds['format']:7}  {ds['num_rows']:>9} rows  {ds['size_bytes']:>11} bytes  {ds['name']}")
    return 0


def _format_event(kind: str, data: dict) -> str:
    if kind == "state":
        return "state: " + ", ".join(f"{k}={v}" for k, v in data.items())
    names = {"train/loss_sum": "loss", "rollout/reward_mean": "reward", "eval/accuracy": "eval_accuracy",
             "time/step_s": "step_s"}
    shown = [f"{name}={data[k]:.4g}" for k, name in names.items() if isinstance(data.get(k), (int, float))]
    return f"step {data.get('step')}: " + " ".join(shown) if shown else ""


def _cmd_logs(args) -> int:
    import httpx

    base, headers = _server(args)
    if args.output:
        with httpx.stream("GET", _job_url(base, args.job, "/logs"), headers=headers, timeout=60) as r:
            if r.status_code >= 400:
                r.read()
                raise SystemExit(f"error: {r.status_code}: {r.json().get('error', r.text)}")
            for chunk in r.iter_text():
                sys.stdout.write(chunk)
        return 0
    url = _job_url(base, args.job, "/events")
    try:
        return _follow_events(url, headers, follow=args.follow, as_json=args.json)
    except httpx.HTTPError as e:
        raise SystemExit(f"error: {e}") from None


def _follow_events(url: str, headers: dict, *, follow: bool, as_json: bool) -> int:
    """Print a job's events until its stream ends; a stream the server ended as idle (no event for
    its event_stream_idle_s) is reopened after the last event id seen. Keep-alive comments are
    skipped like any line that is not a field we read."""
    import httpx

    after = 0
    while True:
        with httpx.stream("GET", url, headers=headers, params={"follow": str(follow).lower(), "after": after},
                          timeout=None) as r:
            if r.status_code >= 400:
                r.read()
                raise SystemExit(f"error: {r.status_code}: {r.json().get('error', r.text)}")
            kind = None
            for line in r.iter_lines():
                if line.startswith("id: "):
                    after = int(line[4:])
                elif line.startswith("event: "):
                    kind = line[7:]
                elif line.startswith("data: "):
                    data = json.loads(line[6:])
                    if kind == "end":
                        print(f"job ended: {data['state']}")
                        return 0 if data["state"] == "succeeded" or not follow else 1
                    if kind == "idle":
                        break  # reconnect from `after`
                    shown = json.dumps(data) if as_json else _format_event(kind, data)
                    if shown:
                        print(shown, flush=True)
            else:
                return 0  # closed without an end: a server that does not send one


def _client_args(p) -> None:
    p.add_argument("--server", help="job service URL (default: $LOCKSTEP_SERVER or http://127.0.0.1:8000)")
    p.add_argument("--api-key", help="tenant API key (default: $LOCKSTEP_API_KEY)")
    p.add_argument("--json", action="store_true", help="machine-readable output")


def _service_args(p, *, client: bool = False) -> None:
    p.add_argument("--db", help="store URL (default: sqlite under $LOCKSTEP_HOME/service)")
    if not client:
        p.add_argument("--storage", help="storage URL: a directory or s3://bucket/prefix (default: under $LOCKSTEP_HOME)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lockstep", description="RL post-training with bit-for-bit consistency")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a training job (default: the embedded SFT + GRPO arithmetic run)")
    run.add_argument("config", nargs="?", help="TOML run config (default: the embedded default)")
    run.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rl.max_staleness=2")
    run.add_argument("--run-dir", help="where to write the run (default: runs/<timestamp>)")
    run.add_argument("--ray-address", help="join an existing Ray cluster instead of starting one")
    run.add_argument("--dry-run", action="store_true", help="print the resolved config and plan, then exit")
    run.add_argument("--resume", metavar="DIR", help="continue the run in DIR from its newest checkpoint")
    run.add_argument("--metrics-port", type=int, metavar="PORT",
                     help="serve the run's step metrics for Prometheus at http://127.0.0.1:PORT/metrics")
    run.add_argument("--dashboard", type=int, nargs="?", const=DASHBOARD_PORT, metavar="PORT",
                     help=f"serve the run's live page at http://127.0.0.1:PORT/ (default port {DASHBOARD_PORT})")
    run.add_argument("--alerts", metavar="FILE", help="alert rules TOML (default: the shipped rules, "
                                                       "src/lockstep/monitor/default_alerts.toml)")
    run.add_argument("--alert-webhook", metavar="URL", help="POST alerts (firing and resolved) to URL as JSON; "
                                                            "with --alerts or this, alerts also go to RUN_DIR/alerts.jsonl")
    run.set_defaults(func=_cmd_run)
    plan = sub.add_parser("plan", help="the parallel strategy and predicted step time for a config (docs/planner.md)")
    plan.add_argument("config", nargs="?", help="TOML run config (default: the embedded default)")
    plan.add_argument("overrides", nargs="*", help="dotted overrides, e.g. rl.group_size=16")
    plan.add_argument("--gpus", metavar="KIND:COUNT", help="plan for a GPU cluster, e.g. H100-SXM:16 "
                                                           "(kinds: A100-40G, A100-80G, H100-SXM, H200)")
    plan.add_argument("--cpus", type=int, metavar="N", help="plan for N cores of this machine (default: runtime.cpus or all)")
    plan.add_argument("--model-config", metavar="PATH", help="a Hugging Face config.json for the model's shape "
                                                             "(default: the config's model)")
    plan.add_argument("--prompt-tokens", type=int, metavar="N", help="tokens of a typical prompt (needed where the "
                                                                     "env's prompts come from data)")
    plan.add_argument("--zero-variance", type=float, default=0.0, metavar="F",
                      help="share of prompt groups without reward signal (a run logs filter/zero_variance): "
                           "the runtime draws more rollout batches for them (default 0)")
    plan.add_argument("--json", action="store_true", help="print the strategy as JSON")
    plan.set_defaults(func=_cmd_plan)
    dash = sub.add_parser("dashboard", help="a run's live page in the browser (or a list of a directory's runs)")
    dash.add_argument("run_dir", metavar="RUN_DIR")
    dash.add_argument("--port", type=int, default=DASHBOARD_PORT, help=f"port on 127.0.0.1 (default {DASHBOARD_PORT})")
    dash.set_defaults(func=_cmd_dashboard)
    trace = sub.add_parser("trace", help="a run's spans as Chrome/Perfetto trace-event JSON")
    trace.add_argument("run_dir", metavar="RUN_DIR")
    trace.add_argument("-o", "--output", metavar="FILE", required=True, help="where to write the trace (JSON)")
    trace.set_defaults(func=_cmd_trace)
    check = sub.add_parser("check", help="self-checks")
    check_sub = check.add_subparsers(dest="check", required=True)
    cons = check_sub.add_parser("consistency", help="sampler vs trainer logprobs, bit for bit")
    cons.add_argument("--model", help="local HF model directory (default: the built-in tiny model)")
    cons.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    cons.add_argument("--seed", type=int, default=0)
    cons.add_argument("--max-tokens", type=int, default=16)
    from lockstep.config.types import DRAFTERS

    cons.add_argument("--speculative", choices=DRAFTERS, default="off",
                      help="decode speculatively with this drafter (outputs must stay bit for bit)")
    cons.add_argument("--draft-tokens", type=_positive_int, default=4, help="tokens drafted per row and step")
    cons.add_argument("--tenants", type=_positive_int, metavar="K",
                      help="instead: K LoRA adapters (different ranks and targets) on one shared base, sampler and "
                           "trainer packed against alone, bit for bit")
    from lockstep.config.types import DEVICES, DTYPES

    cons.add_argument("--device", choices=DEVICES, default="cpu", help="where both sides compute (cuda: Triton kernels)")
    cons.add_argument("--dtype", choices=DTYPES, default="float32", help="bfloat16 needs --device cuda")
    cons.set_defaults(func=_cmd_check_consistency)
    serve = sub.add_parser("serve", help="the Tinker API and job service (starts a worker too)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    _service_args(serve)
    serve.add_argument("--model", action="append", metavar="NAME=PATH", help="register a local HF model directory")
    serve.add_argument("--no-worker", action="store_true", help="run the API only (start workers with `lockstep worker`)")
    serve.add_argument("--max-body-mb", type=int, default=32, help="largest request body accepted")
    serve.add_argument("--policy", metavar="FILE", help="job policy TOML: caps, allowed env modules, per-tenant "
                                                        "overrides (default: safe built-in caps, built-in envs only)")
    serve.add_argument("--alerts", metavar="FILE", help="the service's alert rules TOML (default: the shipped "
                                                        "src/lockstep/monitor/service_alerts.toml)")
    serve.add_argument("--alert-webhook", metavar="URL", help="POST the service's alerts to URL as JSON (and "
                                                              "$LOCKSTEP_HOME/service/alerts.jsonl)")
    from lockstep.service.serve import add_worker_options

    add_worker_options(serve.add_argument_group("its worker"))
    serve.set_defaults(func=_cmd_serve)
    worker = sub.add_parser("worker", help="a service worker: runs queued requests and jobs on the engine")
    _service_args(worker)
    worker.add_argument("--model", action="append", metavar="NAME=PATH", help="register a local HF model directory")
    worker.add_argument("--policy", metavar="FILE", help="job policy TOML (give the API's own)")
    add_worker_options(worker)
    worker.set_defaults(func=_cmd_worker)
    tenants = sub.add_parser("tenants", help="manage tenants")
    tenants_sub = tenants.add_subparsers(dest="tenants", required=True)
    create = tenants_sub.add_parser("create", help="create a tenant and print its API key once")
    create.add_argument("name")
    _service_args(create, client=True)
    create.add_argument("--json", action="store_true", help='last line: {"tenant": ..., "api_key": ...}')
    create.add_argument("--max-jobs", type=int, default=2, help="concurrent jobs quota")
    create.add_argument("--max-models", type=int, default=16, help="models quota")
    create.set_defaults(func=_cmd_tenants_create)
    rotate = tenants_sub.add_parser("rotate-key", help="issue a tenant a new API key (the old one stops working)")
    rotate.add_argument("name")
    _service_args(rotate, client=True)
    rotate.add_argument("--json", action="store_true", help='last line: {"tenant": ..., "api_key": ...}')
    rotate.set_defaults(func=_cmd_tenants_rotate)
    submit = sub.add_parser("submit", help="submit a run config as a job to the job service")
    submit.add_argument("config", nargs="?", help="TOML run config (default: the embedded default)")
    submit.add_argument("overrides", nargs="*", help="dotted overrides, as for `lockstep run`")
    submit.add_argument("--name", help="job name (default: the config's file name)")
    submit.add_argument("--priority", choices=["reserved", "preemptible"], default="preemptible")
    submit.add_argument("--max-attempts", type=int, default=3, help="attempts before the job fails")
    _client_args(submit)
    submit.set_defaults(func=_cmd_submit)
    jobs = sub.add_parser("jobs", help="list your jobs")
    _client_args(jobs)
    jobs.set_defaults(func=_cmd_jobs)
    logs = sub.add_parser("logs", help="a job's metrics and state changes")
    logs.add_argument("job", help="job id, or any unique prefix of it")
    logs.add_argument("-f", "--follow", action="store_true", help="keep streaming until the job ends")
    logs.add_argument("--output", action="store_true", help="the latest attempt's process output instead")
    _client_args(logs)
    logs.set_defaults(func=_cmd_logs)
    job = sub.add_parser("job", help="one job: state, attempts, error")
    job.add_argument("job", help="job id, or any unique prefix of it")
    _client_args(job)
    job.set_defaults(func=_cmd_job)
    cancel = sub.add_parser("cancel", help="cancel a job")
    cancel.add_argument("job", help="job id, or any unique prefix of it")
    _client_args(cancel)
    cancel.set_defaults(func=_cmd_cancel)
    dataset = sub.add_parser("dataset", help="your data files for jobs (jsonl or parquet)")
    dataset.add_argument("action", choices=["upload", "list", "delete"])
    dataset.add_argument("file", nargs="?", help="upload: the file; delete: the dataset id")
    dataset.add_argument("--name", help="upload: a label (default: the file's name)")
    _client_args(dataset)
    dataset.set_defaults(func=_cmd_dataset)
    from lockstep.sandbox.cli import add_parser as add_sandbox_parser

    add_sandbox_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may follow options (`run cfg.toml --run-dir D rl.steps=5`), which argparse alone
    # cannot interleave with positionals.
    if extra and args.command in ("run", "submit") and all("=" in x and not x.startswith("-") for x in extra):
        args.overrides = [*args.overrides, *extra]
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    from lockstep.config import ConfigError
    from lockstep.engine.types import EngineError

    if getattr(args, "config", None) and "=" in args.config and hasattr(args, "overrides"):  # only overrides given
        args.overrides, args.config = [args.config, *args.overrides], None
    try:
        return args.func(args)
    except (EngineError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
