"""The TRL side of the lockstep-vs-TRL GRPO benchmark: time to a held-out greedy accuracy target.

Trains a local Hugging Face causal LM with TRL's `GRPOTrainer` on lockstep's 3-digit addition task
(`lockstep.envs.arithmetic`) on CPU, evaluates held-out greedy accuracy every `--eval-every`
optimizer steps, stops at `--target` accuracy or after `--max-seconds`, and writes a JSON report.

Run (from the repository root)::

    bash bench/setup_trl.sh          # once: builds bench/.venv-trl (torch 2.13.0 CPU, trl 1.16.0)
    bench/.venv-trl/bin/python bench/trl_grpo.py --model MODEL_DIR --out trl.json \\
        [--learning-rate 2e-4 --prompts-per-step 16 --group-size 8 --max-tokens 6 --temperature 1.0 \\
         --target 0.8 --max-seconds 900 --eval-every 10 --seed 0 --digits 3 --num-heldout 200 --threads 2]

The venv does not install lockstep: only `lockstep.envs.arithmetic` (pure Python, no torch) is
imported, from `<repo>/src` via `sys.path`.

What is matched to lockstep's GRPO stage
-----------------------------------------
* Data: the same problem stream. Optimizer step i trains on exactly
  `ArithmeticTask(digits, seed, num_heldout).problems(i, prompts_per_step, stream="rl")`
  (the dataset holds batches 0..N in order and `shuffle_dataset=False`), and evaluation uses the
  same `task.heldout` list. Prompts are plain text ("123+045="), no chat template; tokenized by
  TRL with `tokenizer(text)`, which for the byte-level tiny tokenizer is identical to lockstep's
  `tokenizer.encode(prompt)` (no BOS is added; checked at start-up).
* Reward: 1.0 iff the completion token ids are exactly the answer followed by EOS
  (lockstep's `is_correct`), computed from the `completion_ids` TRL passes to reward functions
  (TRL cuts each sample just after its first EOS, so an EOS is always the last id when present).
* Batch: `prompts_per_step` prompts x `group_size` samples per optimizer step, all generated
  from the current weights (per_device_train_batch_size = prompts*group, num_generations = group,
  gradient_accumulation_steps = steps_per_generation = num_iterations = 1): strictly on-policy,
  one optimizer step per generation batch, so TRL computes no old log-probs (ratio == 1 in value).
* Sampling: temperature `--temperature`, top_k 0 and top_p 1.0 (off), `max_completion_length =
  --max-tokens`; EOS stops generation (the tokenizer has its own <pad>, distinct from <eos>).
* Optimisation: AdamW (torch, `optim="adamw_torch"`), betas (0.9, 0.99), eps 1e-8, weight decay 0,
  grad-norm clip 1.0, constant LR `--learning-rate`, no warm-up; beta = 0 (no KL, no reference
  model); fp32 on CPU (use_cpu, bf16/fp16 off: TRL otherwise defaults bf16 on), gradient
  checkpointing OFF (TRL's default is on), `torch.set_num_threads(--threads)`.
* Evaluation: greedy (`do_sample=False`), `max_new_tokens = --max-tokens`, all held-out prompts in
  one left-padded batch, exact match as above; at step 0 (before training) and every
  `--eval-every` optimizer steps, plus once more when stopping on time.

What is NOT matched (TRL defaults kept on purpose, recorded under "config" in the JSON)
-------------------------------------------------------------------------------------
* Loss: TRL's default `loss_type` ("dapo" in trl 1.16: token-level clipped surrogate, summed over
  the batch's tokens and divided by the batch's number of completion tokens), `epsilon` 0.2,
  `importance_sampling_level` "token", `scale_rewards` "group" (advantage = (r - mean_group) /
  (std_group + 1e-4)). Zero-variance groups stay in the batch with advantage 0 (they add tokens to
  the normaliser); lockstep's own loss/advantage/truncation handling differs in such details.
* No overlap of generation and training (TRL's transformers-generate path is synchronous).

Timing
------
The clock starts at `on_train_begin` (after model loading and dataset building). Each eval
records `time` (wall seconds since that start, taken when the eval finishes) and
`eval_seconds_so_far` (all evaluation time up to and including that eval), so
`time - eval_seconds_so_far` is pure training wall time. `time_to_target` is that difference at
the first eval with accuracy >= target (null if never), `steps_to_target` its step.
`step_seconds` are per-optimizer-step wall times with evaluation time excluded. The JSON is
rewritten after every eval, so a killed run still leaves its evals behind. `data_check` counts the
training batches whose prompts were not exactly lockstep's batch for that step (must be 0).

Run it on otherwise idle cores: with `--threads 2` and another busy process on a 2-core machine,
torch's OpenMP threads oversubscribe and a step takes ~25x longer (8 s instead of 0.3 s).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))

from lockstep.envs.arithmetic import ArithmeticTask, Problem  # noqa: E402  (pure Python, no torch)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="local Hugging Face model directory")
    p.add_argument("--out", required=True, help="JSON report path")
    p.add_argument("--learning-rate", type=float, default=2e-4)
    p.add_argument("--prompts-per-step", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=6)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--target", type=float, default=0.8)
    p.add_argument("--max-seconds", type=float, default=900.0)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--digits", type=int, default=3)
    p.add_argument("--num-heldout", type=int, default=200)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-steps", type=int, default=0,
                   help="cap on optimizer steps (0: enough for --max-seconds at >= 0.05 s/step)")
    return p.parse_args(argv)


def is_correct_ids(ids, answer: str, tokenizer) -> bool:
    """lockstep's `is_correct`: the answer's tokens, then EOS, and nothing else."""
    ids = list(ids)
    return len(ids) > 0 and ids[-1] == tokenizer.eos_token_id and tokenizer.decode(ids[:-1]) == answer


def make_reward(tokenizer, task: ArithmeticTask | None = None, prompts_per_step: int = 0, group_size: int = 0,
                stats: dict | None = None):
    """The reward function handed to GRPOTrainer.

    With `task` given it also checks, on every call, that the batch is exactly lockstep's: the
    prompts of `task.problems(step, prompts_per_step, stream="rl")`, each repeated `group_size`
    times in a row; `stats["data_order_mismatches"]` counts the calls where it is not.
    """

    def exact_answer_eos(prompts, completions, completion_ids, answer, trainer_state=None, **kwargs):
        if task is not None and trainer_state is not None:
            want = [p.prompt for p in task.problems(trainer_state.global_step, prompts_per_step, stream="rl")]
            got = list(prompts)
            ok = len(got) == len(want) * group_size and all(
                got[k * group_size:(k + 1) * group_size] == [w] * group_size for k, w in enumerate(want))
            stats["reward_calls"] = stats.get("reward_calls", 0) + 1
            stats["data_order_mismatches"] = stats.get("data_order_mismatches", 0) + (not ok)
        return [1.0 if is_correct_ids(ids, a, tokenizer) else 0.0 for ids, a in zip(completion_ids, answer, strict=True)]

    return exact_answer_eos


def build_dataset(task: ArithmeticTask, num_steps: int, prompts_per_step: int):
    from datasets import Dataset

    prompts, answers = [], []
    for i in range(num_steps):
        for p in task.problems(i, prompts_per_step, stream="rl"):
            prompts.append(p.prompt)
            answers.append(p.answer)
    return Dataset.from_dict({"prompt": prompts, "answer": answers})


def greedy_accuracy(model, tokenizer, problems: list[Problem], max_tokens: int) -> float:
    """Held-out greedy exact-match accuracy, one left-padded batch."""
    import torch
    from transformers import GenerationConfig

    was_training = model.training
    model.eval()
    try:
        enc = tokenizer([p.prompt for p in problems], return_tensors="pt", padding=True, padding_side="left")
        gen = GenerationConfig(do_sample=False, max_new_tokens=max_tokens, eos_token_id=tokenizer.eos_token_id,
                               pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id)
        with torch.no_grad():
            out = model.generate(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                                 generation_config=gen)
        new = out[:, enc["input_ids"].shape[1]:].tolist()
        correct = 0
        for row, p in zip(new, problems, strict=True):
            if tokenizer.eos_token_id in row:
                row = row[: row.index(tokenizer.eos_token_id) + 1]
            correct += is_correct_ids(row, p.answer, tokenizer)
        return correct / len(problems)
    finally:
        model.train(was_training)


def main(argv=None) -> int:
    args = parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    import accelerate
    import datasets
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    transformers.set_seed(args.seed)
    task = ArithmeticTask(digits=args.digits, seed=args.seed, num_heldout=args.num_heldout)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    if tokenizer.eos_token_id is None:
        raise SystemExit(f"{args.model}: tokenizer has no eos token")
    pad_was_missing = tokenizer.pad_token is None
    if pad_was_missing:
        tokenizer.pad_token = tokenizer.eos_token
    eval_tokenizer = AutoTokenizer.from_pretrained(args.model)
    if eval_tokenizer.pad_token is None:
        eval_tokenizer.pad_token = eval_tokenizer.eos_token

    # TRL tokenizes plain-text prompts with tokenizer(text); lockstep with tokenizer.encode(text).
    sample = task.heldout[0].prompt
    if tokenizer(text=[sample])["input_ids"][0] != tokenizer.encode(sample):
        raise SystemExit("tokenizer(text) and tokenizer.encode(text) differ: prompts would not match lockstep")

    # Reward sanity check: answer + EOS is correct, answer alone or answer + junk is not.
    reward = make_reward(tokenizer)
    p0 = task.heldout[0]
    ans_ids = tokenizer.encode(p0.answer, add_special_tokens=False)
    assert reward([p0.prompt] * 3, [""] * 3, [ans_ids + [tokenizer.eos_token_id], ans_ids,
                                              ans_ids + ans_ids[:1] + [tokenizer.eos_token_id]],
                  [p0.answer] * 3) == [1.0, 0.0, 0.0]

    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)

    batch = args.prompts_per_step * args.group_size
    num_steps = args.max_steps or max(100, math.ceil(args.max_seconds / 0.05))
    train_dataset = build_dataset(task, num_steps, args.prompts_per_step)

    out_dir = tempfile.mkdtemp(prefix="trl_grpo_")
    config = GRPOConfig(
        output_dir=out_dir,
        # batch: prompts x group completions per optimizer step, all from one generation batch
        per_device_train_batch_size=batch,
        num_generations=args.group_size,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        max_steps=num_steps,
        shuffle_dataset=False,
        # sampling
        max_completion_length=args.max_tokens,
        temperature=args.temperature,
        top_k=0,
        top_p=1.0,
        # loss (TRL defaults for loss_type / scale_rewards / epsilon are kept)
        beta=0.0,
        # optimiser
        learning_rate=args.learning_rate,
        optim="adamw_torch",
        adam_beta1=0.9,
        adam_beta2=0.99,
        adam_epsilon=1e-8,
        weight_decay=0.0,
        max_grad_norm=1.0,
        lr_scheduler_type="constant",
        warmup_steps=0,
        # hardware / precision
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        dataloader_num_workers=0,
        seed=args.seed,
        data_seed=args.seed,
        # no side outputs
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_strategy="steps",
        logging_steps=1,
        disable_tqdm=True,
        log_completions=False,
    )

    report: dict = {
        "trl_version": trl.__version__,
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "accelerate_version": accelerate.__version__,
        "datasets_version": datasets.__version__,
        "config": {
            "model": str(Path(args.model).resolve()),
            "digits": args.digits,
            "seed": args.seed,
            "num_heldout": args.num_heldout,
            "prompts_per_step": args.prompts_per_step,
            "group_size": args.group_size,
            "completions_per_step": batch,
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "target": args.target,
            "max_seconds": args.max_seconds,
            "eval_every": args.eval_every,
            "threads": args.threads,
            "pad_token_was_missing": pad_was_missing,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
            "dataset_steps": num_steps,
            "grpo_config": {k: getattr(config, k) for k in (
                "learning_rate", "per_device_train_batch_size", "num_generations", "gradient_accumulation_steps",
                "steps_per_generation", "generation_batch_size", "num_iterations", "max_steps", "shuffle_dataset",
                "max_completion_length", "temperature", "top_k", "top_p", "min_p", "repetition_penalty", "beta",
                "loss_type", "scale_rewards", "epsilon", "epsilon_high", "delta", "importance_sampling_level",
                "mask_truncated_completions", "top_entropy_quantile", "disable_dropout", "multi_objective_aggregation",
                "optim", "adam_beta1", "adam_beta2", "adam_epsilon", "weight_decay", "max_grad_norm",
                "lr_scheduler_type", "warmup_steps", "use_cpu", "bf16", "fp16", "gradient_checkpointing", "seed",
                "use_vllm", "use_liger_kernel")},
        },
        "evals": [],
        "step_seconds_median": None,
        "time_to_target": None,
        "steps_to_target": None,
    }
    for k in ("optim", "lr_scheduler_type"):  # enums
        v = report["config"]["grpo_config"][k]
        report["config"]["grpo_config"][k] = getattr(v, "value", v)

    def write_report() -> None:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
        os.replace(tmp, out)

    class BenchCallback(TrainerCallback):
        def __init__(self):
            self.t0 = None
            self.eval_total = 0.0
            self.last_mark = None  # end of the last step or eval, whichever is later
            self.step_ends: list[float] = []
            self.step_seconds: list[float] = []
            self.rewards: list[tuple[int, float]] = []
            self.last_eval_step = -1

        def evaluate(self, step: int, model) -> float:
            t = time.perf_counter()
            acc = greedy_accuracy(model, eval_tokenizer, task.heldout, args.max_tokens)
            now = time.perf_counter()
            self.eval_total += now - t
            self.last_mark = now
            self.last_eval_step = step
            ev = {"step": step, "time": round(now - self.t0, 3), "eval_seconds_so_far": round(self.eval_total, 3),
                  "eval_seconds": round(now - t, 3), "accuracy": acc}
            report["evals"].append(ev)
            if acc >= args.target and report["time_to_target"] is None:
                report["time_to_target"] = round(ev["time"] - ev["eval_seconds_so_far"], 3)
                report["steps_to_target"] = step
            self.summarise()
            write_report()
            print(f"[trl_grpo] eval step {step}: accuracy {acc:.3f} at {ev['time']:.1f} s "
                  f"(eval {ev['eval_seconds']:.2f} s)", flush=True)
            return acc

        def summarise(self) -> None:
            if self.step_seconds:
                report["step_seconds_median"] = round(statistics.median(self.step_seconds), 4)
                report["step_seconds_mean"] = round(statistics.fmean(self.step_seconds), 4)
            report["steps_done"] = len(self.step_seconds)
            report["step_end_times"] = [round(t - self.t0, 3) for t in self.step_ends]
            report["step_seconds"] = [round(s, 4) for s in self.step_seconds]
            report["train_reward_mean"] = self.rewards
            report["torch_num_threads"] = torch.get_num_threads()

        def on_train_begin(self, args_, state, control, model=None, **kwargs):
            self.t0 = time.perf_counter()
            self.last_mark = self.t0
            if self.evaluate(0, model) >= args.target:
                control.should_training_stop = True
            return control

        def on_step_end(self, args_, state, control, model=None, **kwargs):
            now = time.perf_counter()
            self.step_ends.append(now)
            self.step_seconds.append(now - self.last_mark)
            self.last_mark = now
            step = state.global_step
            if step % args.eval_every == 0:
                if self.evaluate(step, model) >= args.target:
                    control.should_training_stop = True
            if time.perf_counter() - self.t0 > args.max_seconds:
                control.should_training_stop = True
                report["stopped_on_time"] = True
                if self.last_eval_step != step:
                    self.evaluate(step, model)
            return control

        def on_log(self, args_, state, control, logs=None, **kwargs):
            if logs and "reward" in logs:
                self.rewards.append((state.global_step, round(float(logs["reward"]), 4)))

        def on_train_end(self, args_, state, control, model=None, **kwargs):
            self.summarise()
            report["train_wall_seconds"] = round(time.perf_counter() - self.t0, 3)
            report["train_seconds_excluding_eval"] = round(time.perf_counter() - self.t0 - self.eval_total, 3)
            write_report()

    data_stats = report["data_check"] = {"reward_calls": 0, "data_order_mismatches": 0}
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=make_reward(tokenizer, task, args.prompts_per_step, args.group_size, data_stats),
        args=config,
        train_dataset=train_dataset,
        processing_class=tokenizer,
        callbacks=[BenchCallback()],
    )
    # TRL's defaults as resolved by the trainer itself (they can differ from the config's fields).
    report["config"]["trainer_resolved"] = {
        "loss_type": trainer.loss_type, "scale_rewards": trainer.scale_rewards,
        "epsilon_low": trainer.epsilon_low, "epsilon_high": trainer.epsilon_high, "beta": trainer.beta,
        "num_generations": trainer.num_generations, "eos_token_ids": list(trainer.eos_token_ids),
        "generation_kwargs": {k: v for k, v in trainer.generation_kwargs.items()},
        "ref_model": trainer.ref_model is not None, "optimizer": None,
    }
    trainer.train()
    opt = trainer.optimizer
    if opt is not None:
        g = opt.param_groups[0]
        report["config"]["trainer_resolved"]["optimizer"] = {
            "class": type(getattr(opt, "optimizer", opt)).__name__, "lr": g["lr"], "betas": list(g["betas"]),
            "eps": g["eps"], "weight_decay": g["weight_decay"]}
    write_report()
    print(f"[trl_grpo] done: {len(report['evals'])} evals, median step {report['step_seconds_median']} s, "
          f"time_to_target {report['time_to_target']}, data-order mismatches "
          f"{data_stats['data_order_mismatches']}/{data_stats['reward_calls']}, wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
