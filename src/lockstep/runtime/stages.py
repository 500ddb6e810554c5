"""The stages of a run: supervised warm-up (sft), the RL loop (rl) and held-out evaluation.

Each stage works on the components (`controller.Components`) and records into the run directory
(`rundir.RunDirectory`), which it extends with the run's position. Held-out accuracy is watched
during RL: a collapse (see `accuracy_collapse`) is logged and reported in summary.json.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from lockstep.config import RunSpec
from lockstep.config.types import StageSpec
from lockstep.monitor.trace import Timed
from lockstep.runtime import controller as ctl
from lockstep.runtime.balancer import ThreadBalancer
from lockstep.runtime.plan import Plan
from lockstep.runtime.rundir import RunDirectory
from lockstep.runtime.types import RolloutRequest

log = logging.getLogger("lockstep.run")

REBALANCE_EVERY = 25
"""RL steps between thread-budget decisions (asynchronous stages only)."""

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

    def rebalance(self, balancer: ThreadBalancer, window: dict) -> None:
        """End a window of REBALANCE_EVERY steps: log how busy each stage was and the step rate,
        and switch to the thread plan the balancer picks from the measured rates."""
        now, busy = time.time(), self._busy()
        secs = now - window["since"]
        gen, tr = (busy[0] - window["busy"][0]) / secs, (busy[1] - window["busy"][1]) / secs
        rate = REBALANCE_EVERY / secs
        self.metrics.log(self.pos["global_step"], {"placement/generator_busy": gen, "placement/trainer_busy": tr,
                                                   "placement/steps_per_s": rate})
        plan = balancer.next_plan(rate)
        if plan != self.c.threads:
            self.set_threads(*plan)
        window.update(since=time.time(), busy=self._busy())

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

    def rl(self, stage: StageSpec, index: int) -> float:
        cpus = self.plan.num_cpus
        balancer = ThreadBalancer(cpus)
        if stage.max_staleness == 0:  # synchronous: the stages take turns, each may use every core
            self.set_threads(cpus, cpus)
        else:  # concurrent: the plan is chosen by measured step rate
            self.set_threads(*balancer.current)
        started = time.time() - self.pos["stage_elapsed"]
        busy0 = self._busy()
        window = {"since": time.time(), "busy": busy0}
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
            if step % stage.eval_every == 0:
                state["acc"] = self.evaluate("rl")
            if stage.max_staleness > 0 and step % REBALANCE_EVERY == 0:
                self.rebalance(balancer, window)
            self.progress(self.pos["global_step"], f"rl {step}/{stage.steps}", state["acc"], reward=record["rollout/reward_mean"])
            self.maybe_checkpoint()

        def should_stop(step):
            if stage.max_seconds and time.time() - started > stage.max_seconds:
                return True
            return bool(stage.target_accuracy and state["acc"] >= stage.target_accuracy)

        steps = ctl.rl_stage(self.loop, on_step, should_stop) - first
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
                   "weight_swap_latency_s_max": gen["swap_latency_s_max"], "generator_stall_s_max": gen["stall_s_max"],
                   "generator_replicas": gen["replicas"], "generator_requests": gen["requests"],
                   "nodes": {name: c.stat(name)["node"] for name in c.actors()}, "counters": dict(c.stats),
                   "ledger": self.ledger.counts(), "stages": p["stage_rows"],
                   "data": {k: vars(v) for k, v in self.suite.data_reports.items()}}
        self.write_summary(summary)
        return summary
