"""The stages of a run: supervised warm-up (sft), the RL loop (rl) and held-out evaluation.

Each stage works on the components (`controller.Components`) and records into the run directory
(`rundir.RunDirectory`), which it extends with the run's position. Held-out accuracy is watched
during RL: a collapse (see `accuracy_collapse`) is logged and reported in summary.json.
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path

import ray

from lockstep.config import RunSpec
from lockstep.config.types import StageSpec
from lockstep.monitor.trace import Timed
from lockstep.runtime import controller as ctl
from lockstep.runtime.allocator import Allocator, Decision, Window
from lockstep.runtime.plan import Plan, stage_env_workers
from lockstep.runtime.rundir import RunDirectory
from lockstep.runtime.types import RolloutRequest

log = logging.getLogger("lockstep.run")

COLLAPSE_FRACTION, COLLAPSE_DROP = 0.5, 0.1
"""Held-out accuracy has collapsed when an RL evaluation falls below this fraction of the best
earlier one and at least this far below it in absolute terms (0.285 -> 0.000 is one; 0.10 ->
0.04 is noise on 200 problems, not one)."""


def env_record(batch) -> dict[str, float]:
    """The mean of each numeric env metric over the batch's samples ("env/<name>"), e.g. the code
    env's timeouts and the tool env's calls; "correct" is rollout/accuracy already."""
    sums: dict[str, float] = {}
    samples = [s for g in batch for s in g.samples]
    for s in samples:
        for k, v in s.metrics.items():
            if k != "correct" and isinstance(v, (int, float)) and not isinstance(v, bool):
                sums[k] = sums.get(k, 0.0) + float(v)
    out = {f"env/{k}": v / len(samples) for k, v in sums.items()}
    forked = [s for s in samples if s.family >= 0]
    if forked:
        out["rollout/forked_share"] = len(forked) / len(samples)
    return out


def accuracy_collapse(evals: list[dict]) -> dict | None:
    """Whether the newest evaluation shows a collapse against the best before it: its step and
    accuracy, and the best accuracy and its step; None otherwise."""
    if len(evals) < 2:
        return None
    new, best = evals[-1], max(evals[:-1], key=lambda e: e["accuracy"])
    if new["accuracy"] < COLLAPSE_FRACTION * best["accuracy"] and best["accuracy"] - new["accuracy"] >= COLLAPSE_DROP:
        return {"step": new["step"], "accuracy": new["accuracy"], "best_step": best["step"],
                "best_accuracy": best["accuracy"]}
    return None



def router_record(metrics: dict) -> dict:
    """A mixture of experts' router load per MoE layer (router/l<i>_max_load, _experts_used)."""
    return {k.split(":")[0]: v for k, v in metrics.items() if k.startswith("router/")}

class Run(RunDirectory):
    """A run's stages, on its components, recorded in its run directory."""

    def __init__(self, spec: RunSpec, plan: Plan, run_dir: Path, progress, suite, data, c: ctl.Components):
        super().__init__(spec, run_dir, c)
        self.plan, self.progress, self.suite, self.data = plan, progress, suite, data
        self.heldout = list(suite.heldout())

    def start(self, ckpt: Path | None) -> None:
        """From a checkpoint's position, or from the base model (evaluated first)."""
        if ckpt is not None:
            return self.restore(ckpt)
        self.start_fresh()
        self.pos["accs"]["eval_accuracy_start"] = self.evaluate("start")

    def execute(self) -> dict:
        for i in range(self.pos["stage"], len(self.spec.stages)):
            stage = self.spec.stages[i]
            self.sft(stage, i) if stage.kind == "sft" else self.rl(stage, i)
        return self.finish()

    # -- measurements ------------------------------------------------------------------------
    def _busy(self) -> tuple[float, float]:
        return self.c.generator_stat()["busy_s"], self.c.stat("trainer")["busy_s"]

    def _rollout_all(self, group_size: int, temperature: float) -> list:
        """The held-out set, spread over the env workers and the generator replicas, under the
        newest published weights (a rolling update is let finish first)."""
        self.c.settle()
        envs, b, router = self.c.envs, self.heldout, self.c.fleet.router
        chunks = [b[i :: len(envs)] for i in range(len(envs))]
        reqs = [RolloutRequest(tuple(x.group_id for x in ch), tuple(ch), group_size, temperature, 12345,
                               routes=router.assign(len(ch)))
                for ch in chunks if ch]
        try:
            results = self.c.call(lambda: [e.rollout.remote(r) for e, r in zip(envs, reqs)], "evaluation")
        finally:
            for r in reqs:
                router.release(r.routes)
        return [g for groups in results for g in groups]

    def evaluate(self, stage: str, *, pass_k: int = 0) -> float:
        t, started = time.perf_counter(), time.time()
        groups = self._rollout_all(1, 0.0)
        acc = sum(s.correct for g in groups for s in g.samples) / max(1, len(groups))
        record = {"eval/accuracy": acc, "eval/stage": stage}
        if pass_k:
            sampled = self._rollout_all(pass_k, 1.0)
            record[f"eval/pass@{pass_k}"] = sum(any(s.correct for s in g.samples) for g in sampled) / max(1, len(sampled))
        self.pos["eval_seconds"] = self.pos.get("eval_seconds", 0.0) + time.perf_counter() - t
        if self.c.spans is not None:
            self.c.spans.span("evaluate", "evaluation", started, time.time(), stage=stage, accuracy=acc)
        self.pos["evals"].append({"step": self.pos["global_step"], "stage": stage, "time": time.time() - self.t0,
                                  "eval_seconds_so_far": self.pos["eval_seconds"], "accuracy": acc,
                                  **{k.split("/")[1]: v for k, v in record.items() if "@" in k}})
        self.metrics.log(self.pos["global_step"], record)
        if stage == "rl":
            self._watch_collapse()
        return acc

    def _watch_collapse(self) -> None:
        collapse = accuracy_collapse(self.pos["evals"])
        if collapse is None or self.pos.get("collapse"):
            return
        self.pos["collapse"] = collapse
        message = (f"held-out accuracy collapsed during RL: {collapse['accuracy']:.3f} at step {collapse['step']}, "
                   f"from {collapse['best_accuracy']:.3f} at step {collapse['best_step']} (below "
                   f"{COLLAPSE_FRACTION:g} of the best and {COLLAPSE_DROP:g} lower); the learning rate may be too "
                   f"high for this model (summary.json: accuracy_collapsed)")
        log.warning(message)
        self.metrics.log(self.pos["global_step"], {"warning": message})  # what `lockstep logs` streams

    def set_threads(self, trainer: int, generator: int) -> None:
        """The thread budget per stage: on a CPU box, cores are the resource to balance."""
        self.c.set_threads(trainer, generator)
        replicas = self.c.stat("trainer").get("replicas", 1)  # as the trainer counts its own processes
        self.metrics.log(self.pos["global_step"], {"placement/trainer_threads": trainer,
                                                   "placement/generator_threads": self.c.replica_threads(),
                                                   "placement/trainer_replicas": replicas,
                                                   "placement/generator_replicas": len(self.c.fleet.router.live)})

    # -- the allocator (asynchronous RL stages) ----------------------------------------------
    def _open_window(self) -> dict:
        """Counters at the start of an allocator window (see rebalance)."""
        envs = {f"env{i}": self.c.stat(f"env{i}")["busy_s"] for i in range(len(self.c.envs))}
        return {"since": time.time(), "busy": self._busy(), "envs": envs, "sampled": self.c.stats["tokens/sampled"],
                "steps": 0, "samples": 0, "completion_tokens": 0, "in_flight": 0, "buffered": 0}

    @contextlib.contextmanager
    def _outside_window(self, window: dict):
        """An evaluation is not the loop's work: its seconds and busy time leave the window."""
        t, busy = time.time(), self._busy()
        yield
        now = self._busy()
        window["since"] += time.time() - t
        window["busy"] = tuple(w + (b - a) for w, a, b in zip(window["busy"], busy, now))

    @staticmethod
    def _window_step(window: dict, batch, counts: dict) -> None:
        window["steps"] += 1
        window["samples"] += sum(len(g.samples) for g in batch)
        window["completion_tokens"] += sum(len(x.tokens) for g in batch for x in g.samples)
        window["in_flight"] += counts["queue/in_flight_batches"]
        window["buffered"] += counts["queue/buffered_groups"]

    def _measure(self, window: dict) -> Window:
        """The window's measurements: busy fractions, rates, queue means, CPUs."""
        secs, steps, busy = time.time() - window["since"], max(1, window["steps"]), self._busy()
        env_busy = [max(0.0, self.c.stat(f"env{i}")["busy_s"] - window["envs"].get(f"env{i}", 0.0))
                    for i in range(len(self.c.envs))]
        return Window(steps_per_s=window["steps"] / secs,
                      sampled_tokens_per_s=(self.c.stats["tokens/sampled"] - window["sampled"]) / secs,
                      completion_tokens=window["completion_tokens"] / max(1, window["samples"]),
                      generator_busy=(busy[0] - window["busy"][0]) / secs,
                      trainer_busy=(busy[1] - window["busy"][1]) / secs,
                      env_busy=sum(env_busy) / len(env_busy) / secs,
                      in_flight_batches=window["in_flight"] / steps, buffered_groups=window["buffered"] / steps,
                      budget_cpus=self.plan.num_cpus, cluster_cpus=int(ray.cluster_resources().get("CPU", 0)),
                      generator_replicas=len(self.c.fleet.router.live))

    def rebalance(self, allocator: Allocator | None, window: dict) -> dict:
        """End an allocator window: log how busy each stage was and the rates; with the allocator
        on, apply and log its decision. Returns the next window."""
        w = self._measure(window)
        record = {"placement/generator_busy": w.generator_busy, "placement/trainer_busy": w.trainer_busy,
                  "placement/steps_per_s": w.steps_per_s}
        if allocator is not None:
            decision = allocator.decide(w)
            self._apply(decision)
            record.update({**decision.metrics(), "alloc/steps_per_s": w.steps_per_s,
                           "alloc/sampled_tokens_per_s": w.sampled_tokens_per_s,
                           "alloc/completion_tokens": w.completion_tokens, "alloc/env_busy": w.env_busy,
                           "alloc/cluster_cpus": w.cluster_cpus, "alloc/retiring_env_workers": len(self.c.retiring)})
        self.metrics.log(self.pos["global_step"], record)
        return self._open_window()

    def _apply(self, d: Decision) -> None:
        """Threads, generator replicas and env workers (added once started, retired once drained)
        and the cluster CPU request."""
        c = self.c
        while len(c.fleet.router.live) + len(c.starting_generators) < d.generator_replicas:
            c.start_generator(*self._new_generator())
        while len(c.fleet.router.live) > max(1, d.generator_replicas - len(c.starting_generators)):
            c.retire_generator()
        if d.plan != c.threads:
            self.set_threads(*d.plan)
        while len(c.envs) + len(c.starting) < d.env_workers:
            c.start_env(self._new_env_worker())
        while len(c.envs) > max(1, d.env_workers - len(c.starting)):
            c.retire_env()
        c.poll_envs()
        c.request_cpus(d.request_cpus)

    def _free_cpus(self, share: float) -> float:
        """The plan's shares fill the cluster's CPUs (run.build): an actor beyond them takes what is
        free, else none, so that Ray never leaves it pending; threads, not Ray's count, bound the work."""
        return min(share, ray.available_resources().get("CPU", 0.0))

    def _new_generator(self):
        """(index, actor): a generator replica like those the run was built with, under a new index."""
        from lockstep.runtime.run import generator_replica, resolve_model, spread  # run.py imports this module

        i = self.c.fleet.new_index()
        others = spread(self.plan)[1]
        self.c.stats["alloc/generator_replicas_started"] += 1
        return i, generator_replica(self.spec, resolve_model(self.spec), self.dir, i,
                                    self._free_cpus(self.plan.generator_cpus), **others[i % len(others)])

    def _new_env_worker(self):
        """An EnvWorker like those the run was built with (run.build), under a name not used yet:
        a retired worker may still be draining under its old one."""
        from lockstep.runtime.run import env_worker, resolve_model  # run.py imports this module

        serial = self.c.stats["alloc/env_workers_started"]
        self.c.stats["alloc/env_workers_started"] += 1
        return env_worker(self.spec, resolve_model(self.spec), self.dir, f"env-alloc{serial:.0f}",
                          self._free_cpus(self.plan.env_cpus))

    def _end_stage(self, kind: str, started: float, busy0, steps: int, samples: int) -> None:
        """Per-stage throughput and idle fractions, then a checkpoint at the stage boundary."""
        secs = time.time() - started
        (g, t), (g0, t0) = self._busy(), busy0
        self.pos["stage_rows"].append({
            "stage": kind, "seconds": round(secs, 1), "steps": steps, "steps_per_s": round(steps / secs, 2),
            "samples_per_s": round(samples / secs, 1),
            "generator_idle": round(1 - (g - g0) / secs, 2), "trainer_idle": round(1 - (t - t0) / secs, 2),
        })
        self.pos.update(stage=self.pos["stage"] + 1, stage_step=0, stage_elapsed=0.0, rl=None)
        self.loop = None
        self.checkpoint()

    # -- stages ------------------------------------------------------------------------------
    def sft(self, stage: StageSpec, index: int) -> float:
        from lockstep.engine.types import Datum

        cpus = self.plan.num_cpus
        self.set_threads(cpus, cpus)  # only the trainer works (the generator only evaluates)
        acc = self.pos["evals"][-1]["accuracy"]
        started, busy0, first = time.time(), self._busy(), self.pos["stage_step"]
        for k in range(first, stage.steps):
            data = [Datum.from_tokens(e.prompt + e.completion, weights=[0.0] * (len(e.prompt) - 1) + [1.0] * len(e.completion))
                    for e in self.data[index].get_batch(k)]
            with Timed(self.c.spans, "sft step", "trainer", step=k + 1):
                metrics = ctl.wait(self.c.trainer.train.remote(data, "cross_entropy", ctl.adam(stage)), self.c.timeout,
                                   "trainer.train")
            self.c.stats["tokens/trained"] += sum(len(d.model_input) for d in data)
            self.pos["global_step"] += 1
            self.pos["stage_step"] = k + 1
            self.metrics.log(self.pos["global_step"], {"stage": index, "train/loss_sum": metrics["loss:sum"],
                                                       "train/grad_norm": metrics["grad_norm:mean"],
                                                       "train/entropy": metrics.get("entropy:mean"),
                                                       **router_record(metrics)})
            self.progress(self.pos["global_step"], f"sft {k + 1}/{stage.steps}", acc)
            if (k + 1) % stage.eval_every == 0 or k + 1 == stage.steps:
                self.c.publish()
                acc = self.evaluate("sft")
                if stage.target_accuracy and acc >= stage.target_accuracy:
                    break
            self.maybe_checkpoint()
        self.c.publish()
        if self.spec.env.pass_k:
            acc = self.evaluate("sft", pass_k=self.spec.env.pass_k)
        steps = self.pos["stage_step"] - first
        self.pos["accs"]["eval_accuracy_after_sft"] = acc
        self._end_stage("sft", started, busy0, steps, steps * stage.batch_size)
        return acc

    def _rl_record(self, index: int, batch, metrics: dict, counts: dict, step_s: float) -> dict:
        rewards = [s.reward for g in batch for s in g.samples]
        tokens = sum(len(s.tokens) for g in batch for s in g.samples)
        record = {"stage": index, "train/loss_sum": metrics["loss:sum"], "train/grad_norm": metrics["grad_norm:mean"],
                  "train/entropy": metrics.get("entropy:mean"), "rollout/reward_mean": sum(rewards) / len(rewards),
                  "rollout/accuracy": sum(s.correct for g in batch for s in g.samples) / len(rewards),
                  "rollout/turns_mean": sum(s.turns for g in batch for s in g.samples) / len(rewards),
                  "time/step_s": step_s, "time/trainer_busy_s": metrics["trainer_busy_s:sum"],
                  "throughput/samples_per_s": len(rewards) / step_s, "throughput/sampled_tokens_per_s": tokens / step_s,
                  **counts}
        record.update({f"loss/{k.split(':')[0]}": v for k, v in metrics.items()
                       if k.split(":")[0] in ("importance_ratio", "clip_fraction")})
        # The mismatch panel: mismatch/abs (mean |Δlogp|), abs_max, k3_kl, ess; masked_fraction with MIS.
        record.update({"mismatch/" + k.split(":")[0].removeprefix("mismatch_") + ("_max" if k.endswith(":max") else ""): v
                       for k, v in metrics.items() if k.startswith("mismatch_")})
        if "mis_masked_fraction:mean" in metrics:
            record["mismatch/masked_fraction"] = metrics["mis_masked_fraction:mean"]
        record.update(router_record(metrics))
        record.update(env_record(batch))
        return record

    def _speculative_record(self, state: dict, gen: dict) -> dict:
        """The generator's speculative-decoding counters since the last step (none when it is off)."""
        if self.spec.rollout.speculative.drafter == "off":
            return {}
        now = gen["speculative"]
        last, state["spec"] = state.get("spec") or {k: 0 for k in now}, now
        d = {k: now[k] - last.get(k, 0) for k in now}
        draft = {}
        if "draft_version" in now:  # a learning drafter: which draft drafted, and how far behind the policy
            draft = {"speculative/draft_version": now["draft_version"],
                     "speculative/draft_lag": gen["version"] - now["draft_data_version"],
                     "speculative/draft_train_steps": now["draft_train_steps"]}
            if now["draft_train_steps"]:
                draft["speculative/draft_loss"] = now["draft_loss"]
        return {**draft,"speculative/acceptance": d["accepted"] / d["drafted"] if d["drafted"] else 0.0,
                "speculative/accepted_per_verify": d["accepted"] / d["row_verifies"] if d["row_verifies"] else 0.0,
                "speculative/drafted": d["drafted"], "speculative/accepted": d["accepted"],
                "speculative/drafter_errors": d["drafter_errors"], "speculative/auto_off_steps": d["auto_off_steps"],
                "time/draft_s": d["draft_seconds"],
                "time/verify_s": d["verify_seconds"]}

    def _allocator(self, stage: StageSpec) -> Allocator | None:
        """Set the stage's starting threads; the allocator that re-plans them, if any."""
        cpus, r = self.plan.num_cpus, self.spec.runtime
        if stage.max_staleness == 0:  # synchronous: the stages take turns, each may use every core
            self.set_threads(cpus, cpus)
            return None
        if not r.allocator:  # static: as configured
            self.set_threads(r.trainer_threads, r.generator_threads)
            return None
        replicas = len(self.c.fleet.router.live)
        most_envs = max(r.env_workers, stage_env_workers(stage, cpus))  # more are never busy at once
        allocator = Allocator(cpus, env_workers=len(self.c.envs), max_env_workers=most_envs,
                              generator_replicas=replicas,
                              max_generator_replicas=self.plan.max_generator_replicas)
        self.set_threads(*allocator.current)
        return allocator

    def _close_allocation(self) -> None:
        """At the stage's end: settle the env workers and replicas starting or retiring, give back
        any CPUs. (A retired replica still holding groups of the stage is stopped once the next
        stage's loop has dropped them, or at the run's end.)"""
        self.c.poll_envs(block=True)
        self.c.poll_generators(block=True)
        self.c.request_cpus(0)

    def rl(self, stage: StageSpec, index: int) -> float:
        allocator = self._allocator(stage)
        started = time.time() - self.pos["stage_elapsed"]
        busy0 = self._busy()
        window = self._open_window()
        fork = self.spec.rollout.fork
        self.loop = ctl.RLLoop(self.c, stage, index, self.data[index], self.ledger, seed=self.spec.seed,
                               position=self.pos["rl"], fork=(fork.turn, fork.branches))
        first = self.loop.step
        state = {"acc": self.pos["evals"][-1]["accuracy"], "last": time.perf_counter()}

        def on_step(step, batch, metrics, counts):
            now = time.perf_counter()
            self.pos["global_step"] += 1
            self.pos["stage_step"], self.pos["stage_elapsed"] = step, time.time() - started
            record = self._rl_record(index, batch, metrics, counts, now - state["last"])
            gen = self.c.generator_stat()
            record.update({"policy/trainer_version": self.c.version, "policy/generator_version": gen["version"],
                           "weights/stall_max_s": gen["stall_s_max"], "rollout/replicas": gen["replicas"]})
            record.update(self._speculative_record(state, gen))
            self.c.stats["tokens/trained"] += sum(len(g.prompt) + len(x.tokens) for g in batch for x in g.samples)
            state["last"] = now
            self.metrics.log(self.pos["global_step"], record)
            self._window_step(window, batch, counts)
            self.c.poll_envs()  # an env worker the allocator started is used as soon as it is up
            if self.c.poll_generators():  # a replica joined: the window measures the fleet with it
                window.update(self._open_window())
            if step % stage.eval_every == 0:
                with self._outside_window(window):
                    state["acc"] = self.evaluate("rl")
            if (stage.max_staleness > 0 and window["steps"] >= self.spec.runtime.allocator_window
                    and not self.c.starting_generators):
                window.update(self.rebalance(allocator, window))
            self.progress(self.pos["global_step"], f"rl {step}/{stage.steps}", state["acc"], reward=record["rollout/reward_mean"])
            self.maybe_checkpoint()

        def should_stop(step):
            if stage.max_seconds and time.time() - started > stage.max_seconds:
                return True
            return bool(stage.target_accuracy and state["acc"] >= stage.target_accuracy)

        steps = ctl.rl_stage(self.loop, on_step, should_stop) - first
        self._close_allocation()
        self.evaluate("rl", pass_k=self.spec.env.pass_k)
        for g in self.loop.pending_ids():  # the stage is over: what is still in flight is not needed
            self.ledger.filtered([g], "stage_ended")
        self._end_stage("rl", started, busy0, steps, steps * stage.prompts_per_step * stage.group_size)
        return self.pos["evals"][-1]["accuracy"]

    # -- the end -----------------------------------------------------------------------------
    def finish(self) -> dict:
        self.save_final()
        c, p = self.c, self.pos
        gen, tr = c.generator_stat(), c.stat("trainer")
        wall = time.time() - self.t0
        accs = dict(p["accs"])
        accs.setdefault("eval_accuracy_after_sft", accs["eval_accuracy_start"])
        accs["eval_accuracy_final"] = p["evals"][-1]["accuracy"]
        pass_k = [e for e in p["evals"] if any("@" in k for k in e)]
        summary = {**accs, "accuracy_collapsed": p.get("collapse"), "wall_seconds": wall, "steps": p["global_step"],
                   "evals": p["evals"],
                   **({f"eval_pass@{self.spec.env.pass_k}_final": pass_k[-1][f"pass@{self.spec.env.pass_k}"]} if pass_k else {}),
                   "generator_busy_fraction": gen["busy_s"] / wall, "trainer_busy_fraction": tr["busy_s"] / wall,
                   "weight_swap_latency_s_max": gen["swap_latency_s_max"], "generator_stall_s_max": gen["stall_s_max"], "generator_stalls": gen["stalls"],
                   "generator_replicas": gen["replicas"], "generator_requests": gen["requests"],
                   "nodes": dict(c.nodes), "counters": dict(c.stats),
                   "ledger": self.ledger.counts(), "stages": p["stage_rows"],
                   "data": {k: vars(v) for k, v in self.suite.data_reports.items()}}
        self.write_summary(summary)
        return summary
