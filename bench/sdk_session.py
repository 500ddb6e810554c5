"""One scripted Tinker session, run by any tinker SDK from 0.25 on against a lockstep server.

Run by bench/sdk_matrix.py with the python of a venv holding one tinker version (and nothing of
lockstep: it imports only tinker and numpy), so it uses the API common to 0.25-0.38: a LoRA and a
full model (rank 0), SFT steps, forward, sample, compute_logprobs, save/load state, RL steps with
importance_sampling, and the REST listings. Each step asserts what a user relies on (the loss falls,
sampled logprobs equal compute_logprobs bit for bit, a loaded state gives the saved forward, ...).

    python bench/sdk_session.py --base-url http://127.0.0.1:8000 --api-key KEY --out result.json

Tokens are the built-in model's (one per byte: id = byte + 4, EOS = 2), so no tokenizer is loaded.
The result is JSON: the SDK version, each step with ok / its first error / seconds, and the warnings
the SDK logged (a create_session warning_message among them).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
import traceback

import numpy as np
import tinker
from tinker import types

BYTE_OFFSET, EOS = 4, 2


def encode(text: str) -> list[int]:
    return [b + BYTE_OFFSET for b in text.encode()]


def resolve(x):
    """0.38 returns futures where 0.25 returned clients (its backcompat futures proxy them)."""
    return x.result() if callable(getattr(x, "result", None)) else x


def sft_datum(prompt: str, answer: str) -> types.Datum:
    p, full = encode(prompt), encode(prompt) + encode(answer) + [EOS]
    weights = [0.0] * (len(p) - 1) + [1.0] * (len(full) - len(p))
    return types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(full[1:], np.int64),
                                       "weights": np.array(weights, np.float32)})


SFT_DATA = [sft_datum(f"{a}+{b}=", str(a + b)) for a in range(4) for b in range(4)]
PROMPT = encode("3+4=")


def logprobs(out) -> list[list[float]]:
    return [o["logprobs"].to_numpy().tolist() for o in out.loss_fn_outputs]


def sft_steps(tc, steps: int, lr: float) -> list[float]:
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward(SFT_DATA, "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=lr)).result()
        losses.append(fb.result().metrics["loss:sum"])
    return losses


# -- the steps: each takes the shared state, asserts, and adds what later steps need ----------------
def connect(s: dict) -> None:
    s["sc"] = sc = tinker.ServiceClient(base_url=s["base_url"], api_key=s["api_key"])
    caps = sc.get_server_capabilities()
    assert any(m.model_name == s["model"] for m in caps.supported_models), caps
    # a sampler of the base model needs the session, which some SDKs create lazily: a refused
    # create_session fails here, before any model exists
    base = resolve(sc.create_sampling_client(base_model=s["model"]))
    assert len(base.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result()) == len(PROMPT)


def lora_sft(s: dict) -> None:
    s["lora"] = tc = resolve(s["sc"].create_lora_training_client(base_model=s["model"], rank=8, seed=0))
    losses = sft_steps(tc, 6, 1e-2)
    assert losses[-1] < losses[0], f"the LoRA's loss did not fall: {losses}"


def full_sft(s: dict) -> None:
    s["full"] = tc = resolve(s["sc"].create_lora_training_client(base_model=s["model"], rank=0, seed=0))
    losses = sft_steps(tc, 4, 3e-3)
    assert losses[-1] < losses[0], f"the full model's loss did not fall: {losses}"


def forward(s: dict) -> None:
    got = logprobs(s["lora"].forward(SFT_DATA, "cross_entropy").result())
    assert [len(g) for g in got] == [len(d.loss_fn_inputs["target_tokens"].data) for d in SFT_DATA]
    assert all(v <= 0.0 for g in got for v in g)


def sample(s: dict) -> None:
    s["sampler"] = sampler = s["lora"].save_weights_and_get_sampling_client("matrix")
    res = sampler.sample(prompt=types.ModelInput.from_ints(PROMPT), num_samples=4,
                         sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0, seed=3)).result()
    assert len(res.sequences) == 4
    for seq in res.sequences:
        assert 1 <= len(seq.tokens) <= 6 and len(seq.logprobs) == len(seq.tokens), seq
    s["sequences"] = res.sequences


def compute_logprobs(s: dict) -> None:
    for seq in s["sequences"]:
        scored = s["sampler"].compute_logprobs(types.ModelInput.from_ints(PROMPT + list(seq.tokens))).result()
        assert scored[0] is None and scored[-len(seq.tokens):] == list(seq.logprobs), "sampled != computed logprobs"


def save_load_state(s: dict) -> None:
    tc = s["lora"]
    saved = logprobs(tc.forward(SFT_DATA, "cross_entropy").result())
    s["state_path"] = path = tc.save_state("mid").result().path
    restored = resolve(s["sc"].create_training_client_from_state(path))
    assert logprobs(restored.forward(SFT_DATA, "cross_entropy").result()) == saved, "restored forward differs"
    sft_steps(tc, 1, 1e-2)
    assert logprobs(tc.forward(SFT_DATA, "cross_entropy").result()) != saved
    tc.load_state(path).result()
    assert logprobs(tc.forward(SFT_DATA, "cross_entropy").result()) == saved, "load_state forward differs"


def rl_steps(s: dict) -> None:
    tc = s["lora"]
    for step in range(2):
        sampler = tc.save_weights_and_get_sampling_client(f"rl{step}")
        res = sampler.sample(prompt=types.ModelInput.from_ints(PROMPT), num_samples=8,
                             sampling_params=types.SamplingParams(max_tokens=4, temperature=1.0, seed=step)).result()
        rewards = np.array([float(list(q.tokens[:1]) == encode("7")) for q in res.sequences])
        n, data = len(PROMPT) - 1, []
        for q, adv in zip(res.sequences, rewards - rewards.mean()):
            full = PROMPT + list(q.tokens)
            data.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]), loss_fn_inputs={
                "target_tokens": np.array(full[1:], np.int64),
                "logprobs": np.array([0.0] * n + list(q.logprobs), np.float32),
                "advantages": np.array([0.0] * n + [adv] * len(q.tokens), np.float32)}))
        out = tc.forward_backward(data, "importance_sampling").result()
        # on-policy, with the sampler's own logprobs: every importance ratio is exactly 1
        assert out.metrics["importance_ratio:max"] == 1.0, out.metrics
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()


def rest_listing(s: dict) -> None:
    rc = s["sc"].create_rest_client()
    runs = {r.training_run_id for r in resolve(rc.list_training_runs()).training_runs}
    assert {s["lora"].model_id, s["full"].model_id} <= runs, runs
    checkpoints = [c.checkpoint_id for c in resolve(rc.list_checkpoints(s["lora"].model_id)).checkpoints]
    assert "weights/mid" in checkpoints, checkpoints


STEPS = [connect, lora_sft, full_sft, forward, sample, compute_logprobs, save_load_state, rl_steps, rest_listing]


class Warnings(logging.Handler):
    """The SDK's logged warnings (it logs create_session's warning_message at WARNING)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage()[:500])


def first_error(e: BaseException) -> str:
    where = traceback.extract_tb(e.__traceback__)[-1]
    return f"{type(e).__name__}: {e} ({where.name}:{where.lineno})"[:1000]


def run(base_url: str, api_key: str, model: str) -> dict:
    warnings = Warnings()
    logging.getLogger("tinker").addHandler(warnings)
    state = {"base_url": base_url, "api_key": api_key, "model": model}
    steps = []
    for step in STEPS:
        start = time.monotonic()
        try:
            step(state)
            steps.append({"step": step.__name__, "ok": True, "error": None})
        except Exception as e:  # noqa: BLE001 - the report names it; a step missing what a failed one makes fails too
            steps.append({"step": step.__name__, "ok": False, "error": first_error(e)})
            if step is connect:
                break
        steps[-1]["seconds"] = round(time.monotonic() - start, 2)
    return {"sdk_version": tinker.__version__, "passed": all(x["ok"] for x in steps) and len(steps) == len(STEPS),
            "steps": steps, "warnings": warnings.messages}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--api-key", required=True)
    ap.add_argument("--model", default="lockstep/tiny")
    ap.add_argument("--out", required=True, help="where the JSON result goes")
    args = ap.parse_args()
    result = run(args.base_url, args.api_key, args.model)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    # the SDK's threads may linger on a failed session; the result is written
    logging.shutdown()
    os._exit(0 if result["passed"] else 1)


if __name__ == "__main__":
    main()
