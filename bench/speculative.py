"""Rollout new tokens/s with speculative decoding off and on, side by side in one process.

    .venv/bin/python bench/speculative.py [--rows 1,8,64] [--repeats 3] [--sft-steps 300]

The model: the built-in one after a supervised warm-up on `long_addition` (worked answers of 72
tokens; `lockstep run bench/configs/long_sft.toml`, built once into bench/.work/long_model_<steps>). The workload:
GRPO-shaped rollouts of fresh problems (as the procedural task's training batches are), `rows`
samples in groups of 8 (fewer rows: one group), temperature 1, max_tokens 80, the same seeds on
every side; every timed run gets a fresh drafter, so drafts come from the prompt, the group's
siblings and the row itself, never from a repeat of the same call. Runs alternate (plain, suffix,
suffix with `auto`, plain, ...), medians of the repeats; acceptance is the last suffix run's.
Outputs are asserted identical.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, "bench")
from common import emit, median, timed  # noqa: E402
from rl_common import LOCKSTEP, ROOT  # noqa: E402

from lockstep.engine.drafters import SuffixDrafter  # noqa: E402
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
    ap.add_argument("--work", default="bench/.work")
    a = ap.parse_args()
    model_dir = long_model(Path(a.work).resolve(), a.sft_steps)
    hf, tok = load_model(model_dir)
    model = InvariantLM(hf)
    task = ArithmeticTask(digits=7, seed=0, num_heldout=1, scratchpad=True)
    rows_out = []
    for rows in [int(x) for x in a.rows.split(",")]:
        plain = Sampler(model, tok)
        calls = [requests(tok, task, c, rows) for c in range(a.calls)]
        new_tokens = []

        def speculative(auto: bool) -> Sampler:  # a fresh drafter each run: no memory of an earlier repeat
            return Sampler(model, tok, drafter=SuffixDrafter(), draft_tokens=a.draft_tokens, auto=auto)

        def run(make, record=False, keep=None):
            def go():
                sampler = make()
                outs = [sampler.sample(reqs) for reqs in calls]
                if record:
                    new_tokens.append(sum(len(s.tokens) for out in outs for r in out for s in r.sequences))
                if keep is not None:
                    keep.append(sampler)
                return outs
            return go

        want = run(lambda: plain, record=True)()
        assert run(lambda: speculative(False))() == want and run(lambda: speculative(True))() == want, \
            "speculative decoding changed an output"
        t_plain, t_fast, t_auto, fast, auto = [], [], [], [], []
        for _ in range(a.repeats):
            t_plain += timed(run(lambda: plain), 1)
            t_fast += timed(run(lambda: speculative(False), keep=fast), 1)
            t_auto += timed(run(lambda: speculative(True), keep=auto), 1)
        st, auto_st = fast[-1].spec_stats, auto[-1].spec_stats
        tokens = new_tokens[0]
        rows_out.append({"rows": rows, "new_tokens": tokens, "plain_tok_s": tokens / median(t_plain),
                         "suffix_tok_s": tokens / median(t_fast), "suffix_vs_plain": median(t_plain) / median(t_fast),
                         "auto_tok_s": tokens / median(t_auto), "auto_vs_plain": median(t_plain) / median(t_auto),
                         "acceptance": st.acceptance, "accepted_per_verify": st.mean_accepted,
                         "auto_off_steps": auto_st.auto_off_steps, "auto_verify_steps": auto_st.verify_steps,
                         "draft_s_share": st.draft_seconds / t_fast[-1]})
        print(rows_out[-1], flush=True)
    emit("speculative", rows_out, {"model": str(model_dir), "draft_tokens": a.draft_tokens, "calls": a.calls,
                                   "temperature": 1.0, "max_tokens": 80})


if __name__ == "__main__":
    main()
