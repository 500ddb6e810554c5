"""Rollout new tokens/s with speculative decoding off and on, side by side in one process.

    .venv/bin/python bench/speculative.py [--rows 1,8,64] [--repeats 3] [--sft-steps 300]

The model: the built-in one after a supervised warm-up on `long_addition` (worked answers of 72
tokens; `lockstep run bench/configs/long_sft.toml`, built once into bench/.work/long_model_<steps>). The workload:
GRPO-shaped rollouts of fresh problems (as the procedural task's training batches are), `rows`
samples in groups of 8 (fewer rows: one group), temperature 1, max_tokens 80, the same seeds on
every side; every timed suffix run gets a fresh drafter, so drafts come from the prompt, the group's siblings
and the row itself, never from a repeat of the same call. The model drafter first learns online
from `--warm-calls` rollouts of other problems, then is frozen (so that it cannot memorise the
timed calls, which every repeat samples again). Runs alternate (plain, suffix, suffix with
`auto`, model, model with `auto`, plain, ...), medians of the repeats; acceptance is each side's
last run's. Outputs are asserted identical.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, "bench")
from common import emit, median, timed  # noqa: E402
from rl_common import LOCKSTEP, ROOT  # noqa: E402

from lockstep.engine.drafters import SuffixDrafter, make_drafter  # noqa: E402
from lockstep.engine.loading import load_model  # noqa: E402
from lockstep.engine.model import InvariantLM  # noqa: E402
from lockstep.engine.sampler import Sampler  # noqa: E402
from lockstep.engine.types import SampleRequest, SamplingParams  # noqa: E402
from lockstep.envs.arithmetic import ArithmeticTask  # noqa: E402


def long_model(work: Path, sft_steps: int) -> Path:
    model = work / f"long_model_{sft_steps}"
    if not (model / "config.json").exists():
        run_dir = work / "long_sft_run"
        shutil.rmtree(run_dir, ignore_errors=True)
        subprocess.run([*LOCKSTEP, "run", str(ROOT / "bench/configs/long_sft.toml"), "--run-dir", str(run_dir),
                        f"stages.0.steps={sft_steps}"], check=True, stdout=subprocess.DEVNULL)
        shutil.copytree(run_dir / "final_model", model)
    return model


def requests(tok, task: ArithmeticTask, call: int, rows: int) -> list[SampleRequest]:
    group = min(8, rows)
    problems = task.problems(call, max(1, rows // group), stream="bench")
    return [SampleRequest(tuple(tok.encode(p.prompt)), SamplingParams(max_tokens=80, seed=call * 1000 + i, stop=None),
                          num_samples=group) for i, p in enumerate(problems)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--calls", type=int, default=4, help="sample() calls per timed run")
    ap.add_argument("--draft-tokens", type=int, default=4)
    ap.add_argument("--sft-steps", type=int, default=300)
    ap.add_argument("--warm-calls", type=int, default=30, help="64-row calls the model draft learns from first")
    ap.add_argument("--work", default="bench/.work")
    a = ap.parse_args()
    model_dir = long_model(Path(a.work).resolve(), a.sft_steps)
    hf, tok = load_model(model_dir)
    model = InvariantLM(hf)
    task = ArithmeticTask(digits=7, seed=0, num_heldout=1, scratchpad=True)
    draft, warm = warm_draft(model, tok, task, a.warm_calls, a.draft_tokens)
    print(warm, flush=True)
    sides = {  # a fresh suffix drafter each run: no memory of an earlier repeat; the model draft is frozen
        "suffix": lambda: Sampler(model, tok, drafter=SuffixDrafter(), draft_tokens=a.draft_tokens),
        "suffix_auto": lambda: Sampler(model, tok, drafter=SuffixDrafter(), draft_tokens=a.draft_tokens, auto=True),
        "model": lambda: Sampler(model, tok, drafter=draft, draft_tokens=a.draft_tokens),
        "model_auto": lambda: Sampler(model, tok, drafter=draft, draft_tokens=a.draft_tokens, auto=True),
    }
    rows_out = []
    for rows in [int(x) for x in a.rows.split(",")]:
        plain = Sampler(model, tok)
        calls = [requests(tok, task, c, rows) for c in range(a.calls)]
        want = [plain.sample(reqs) for reqs in calls]
        tokens = sum(len(s.tokens) for out in want for r in out for s in r.sequences)
        times: dict[str, list[float]] = {"plain": [], **{k: [] for k in sides}}
        last = {}

        def run(name):
            def go():
                sampler = plain if name == "plain" else sides[name]()
                outs = [sampler.sample(reqs) for reqs in calls]
                assert outs == want, f"{name}: speculative decoding changed an output"
                last[name] = sampler
            return go

        for _ in range(a.repeats):  # side by side, alternating
            for name in times:
                times[name] += timed(run(name), 1)
        row = {"rows": rows, "new_tokens": tokens, "plain_tok_s": tokens / median(times["plain"])}
        for name in sides:
            st = last[name].spec_stats
            row[f"{name}_vs_plain"] = median(times["plain"]) / median(times[name])
            row[f"{name}_acceptance"] = st.acceptance
            row[f"{name}_accepted_per_verify"] = st.mean_accepted
            row[f"{name}_draft_s_share"] = st.draft_seconds / times[name][-1]
            if name.endswith("auto"):
                row[f"{name}_off_steps"] = st.auto_off_steps
        rows_out.append(row)
        print(row, flush=True)
    emit("speculative", rows_out, {"model": str(model_dir), "draft_tokens": a.draft_tokens, "calls": a.calls,
                                   "temperature": 1.0, "max_tokens": 80, "model_draft": warm})


def warm_draft(model, tok, task: ArithmeticTask, calls: int, k: int):
    """The model drafter after learning online from `calls` rollouts of 64 rows (problems of another
    stream than the timed ones), then frozen: the timed runs repeat the same calls, and a draft
    that kept learning would memorise them."""
    draft = make_drafter("model", target=model, tokenizer=tok, updates=4)
    sampler = Sampler(model, tok, drafter=draft, draft_tokens=k)
    started, rates = time.perf_counter(), []
    for c in range(calls):
        before = (sampler.spec_stats.drafted, sampler.spec_stats.accepted)
        sampler.sample(requests(tok, task, 1000 + c, 64))
        rates.append(round((sampler.spec_stats.accepted - before[1]) / max(1, sampler.spec_stats.drafted - before[0]), 3))
        draft.trainer.wait_idle()
    steps = draft.trainer.steps
    draft.freeze()
    return draft, {"warm_calls": calls, "warm_s": round(time.perf_counter() - started, 1), "train_steps": steps,
                   "draft_version": draft.version, "acceptance_by_call": rates}


if __name__ == "__main__":
    main()
