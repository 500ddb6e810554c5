"""The engine host's packed batches: each batch in as few engine calls as its members' models allow.

    packing.form_batch -> queue.claim_batch -> Handlers.execute_batch -> EngineHost.run_batch:
      1. check every member against the model it runs on, and pin that model (or session) in the
         model cache until the batch is done: readying a later member never evicts an earlier one;
      2. forward / forward_backward: the members on LoRA clients of one shared base go through ONE
         packed_forward(_backward) call (engine/packed.py), one TrainGroup each; a member on a
         private model (full fine-tuning) runs alone;
      3. sample: the members of shared, non-speculative sessions of one base go through ONE
         Sampler.sample call per size class (below), one SampleRequest each with its session's
         adapter snapshot; speculative sessions (each has its own drafter) and private ones alone;
      4. one (body, tokens) or exception per member, encoded exactly as the member alone.

The engine's promise (a group's or a request's bits do not depend on what else is in the call)
makes a packed member's response bytes those it gets alone; a member the engine refuses fails alone
with the message it gets alone: the trainer refuses per group, the sampler's refusals are checked
per request before the call (Sampler.check), and a packed sampling call that still fails is run
again one member at a time, so that only the member at fault fails.

Size classes: a packed sampling call pads every row's KV cache to the longest prompt + max_tokens
of the call, and every prompt to the longest prompt. Members are grouped by the power of two above
each (64 tokens at least), so a member's padded cache and prefill are at most twice its own (or
128 tokens): a co-tenant asking for a long completion cannot multiply the memory of many short ones.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack

from lockstep.service.outcome import attempt

log = logging.getLogger("lockstep.host")


class PackedBatches:
    """EngineHost's run_batch (a mixin: it runs on the host's models, sessions and cache)."""

    def run_batch(self, kind: str, members) -> list:
        """Run a batch of one kind ("forward", "forward_backward" or "sample"; service/packing.py),
        each member on its own model or sampling session (BatchMember), which the caller has
        readied. One result per member, in order: (result body, tokens), or the exception that
        failed that member alone. Every member is checked before any runs, so a bad one (a token
        id out of its model's vocabulary, a loss input missing, a session gone) touches nothing."""
        with ExitStack() as pins:
            checked = [attempt(self._check_and_pin, kind, m, pins) for m in members]
            if kind == "sample":
                results = self._run_samples(members, checked)
            else:
                keys = [m.key for m, c in zip(members, checked) if not isinstance(c, Exception)]
                # packing.py puts a model in a batch at most once: two groups of one model in one
                # pass would sum its gradients in another order than two calls do
                assert len(keys) == len(set(keys)), f"a model appears twice in one batch: {keys}"
                results = self._run_training(kind == "forward", members, checked)
        # The pinned members may have held the cache over its budget (a batch's models are resident
        # together): back under it now, before the next request.
        failed = attempt(self.models.make_room)
        if failed is not None:
            log.warning("could not evict after a packed batch: %s", failed)
        return results

    def _check_and_pin(self, kind: str, member, pins: ExitStack):
        checked = self._check(kind, member)
        key = ("session" if kind == "sample" else "model", member.key)
        self.models.use(key)
        pins.enter_context(self.models.pin(key))
        return checked

    # -- forward, forward_backward ---------------------------------------------------------------
    def _run_training(self, forward_only: bool, members, checked) -> list:
        results = list(checked)
        by_base: dict[int, list[int]] = {}
        for i, (m, c) in enumerate(zip(members, checked)):
            if isinstance(c, Exception):
                continue
            trainer = self.models.peek(("model", m.key))
            if hasattr(trainer, "base"):  # an AdapterTrainer on a shared base
                by_base.setdefault(id(trainer.base), []).append(i)
            else:
                results[i] = attempt(self._forward_backward, m.key, c, forward_only)
        for indices in by_base.values():
            trainers = [self.models.peek(("model", members[i].key)) for i in indices]
            out = attempt(_packed_train, trainers, [checked[i] for i in indices], forward_only)
            for j, i in enumerate(indices):
                results[i] = out if isinstance(out, Exception) else out[j]
        self.batch_stats["train_calls"] += len(by_base)
        self.batch_stats["train_packed_members"] += sum(len(v) for v in by_base.values())
        return results

    # -- sample ----------------------------------------------------------------------------------
    def _run_samples(self, members, checked) -> list:
        results = list(checked)
        packs: dict[tuple, list[tuple[int, object]]] = {}
        for i, (m, c) in enumerate(zip(members, checked)):
            if isinstance(c, Exception):
                continue
            session = self.models.peek(("session", m.key))
            if not session.shared or session.speculation is not None:
                results[i] = attempt(self.sample, m.key, c)
                continue
            request = attempt(sample_request, c, session.adapter)
            if isinstance(request, Exception):
                results[i] = request
                continue
            packs.setdefault((session.base_path, *_size_class(request)), []).append((i, request))
        for (base_path, *_), pack in packs.items():
            self._sample_pack(base_path, members, pack, results)
        return results

    def _sample_pack(self, base_path: str, members, pack: list, results: list) -> None:
        """One Sampler.sample call for `pack` [(member index, SampleRequest)], its results into
        `results`; a request the sampler refuses fails alone, before the call."""
        from lockstep.engine.sampler import Sampler

        base = self._base(base_path)
        sampler = Sampler(base.model, base.tokenizer)
        ok = []
        for i, request in pack:
            refused = attempt(sampler.check, [request])
            if refused is None:
                ok.append((i, request))
            else:
                results[i] = _host_error(refused)
        if not ok:
            return
        out = attempt(sampler.sample, [r for _, r in ok])
        self.batch_stats["sample_calls"] += 1
        self.batch_stats["sample_packed_members"] += len(ok)
        if isinstance(out, Exception):  # not one request's refusal: find the one at fault, alone
            log.warning("a packed sampling call of %d members failed (%s); running them one at a time", len(ok), out)
            for i, request in ok:
                results[i] = attempt(_sample_alone, sampler, request, members[i].payload)
            return
        for (i, _), res in zip(ok, out):
            results[i] = encode_sample(res, members[i].payload)


def _packed_train(trainers: list, fbs: list, forward_only: bool) -> list:
    """One packed call over these trainers (all on one shared base): per member, its encoded
    response or the HostError it gets alone."""
    from lockstep.engine import packed
    from lockstep.engine.types import TrainGroup

    groups = [TrainGroup(t, train_data(fb), fb.loss_fn, fb.loss_fn_config) for t, fb in zip(trainers, fbs)]
    run = packed.packed_forward if forward_only else packed.packed_forward_backward
    outs = run(trainers[0].base, groups)
    return [_host_error(o) if isinstance(o, Exception) else encode_forward(o, g.data) for o, g in zip(outs, groups)]


def _sample_alone(sampler, request, body: dict) -> tuple[bytes, int]:
    try:
        [res] = sampler.sample([request])
    except Exception as e:  # noqa: BLE001 - this member's failure, as alone (a ValueError as HostError)
        raise _host_error(e) from None
    return encode_sample(res, body)


MIN_CLASS = 64
"""Tokens below which sizes are not told apart: short requests pack together whatever their size."""


def _size_class(request) -> tuple[int, int]:
    """The powers of two above a request's prompt and its KV cache (prompt + max_tokens)."""
    n = len(request.prompt)
    return max(n, MIN_CLASS).bit_length(), max(n + request.params.max_tokens, MIN_CLASS).bit_length()


def _host_error(e: Exception) -> Exception:
    """What a member alone raises for an engine refusal (a ValueError: EngineError, LossError)."""
    from lockstep.service.host import HostError

    return HostError(str(e)) if isinstance(e, ValueError) else e


# -- a member's request and response, the same alone and packed -----------------------------------
def train_data(fb) -> tuple:
    from lockstep.engine.types import Datum

    return tuple(Datum(d.model_input, d.loss_fn_inputs) for d in fb.data)


def encode_forward(out, data) -> tuple[bytes, int]:
    from lockstep.service import wire

    return wire.encode_forward_output(out.loss_fn_outputs, out.metrics), sum(len(d.model_input) for d in data)


def sample_request(body: dict, adapter):
    """A sample request's body (checked by EngineHost._check) as the engine's SampleRequest."""
    from lockstep.engine.types import SampleRequest, SamplingParams
    from lockstep.service import sample_extras, wire
    from lockstep.service.host import HostError

    p = body["sampling_params"]
    stop = p.get("stop")
    stop = (stop,) if isinstance(stop, str) else (tuple(stop) if stop is not None else None)
    prompt = wire.tokens_from_model_input(body["prompt"], "prompt")
    target = sample_extras.checked_target(body, len(prompt))
    extras = {"topk_prompt_logprobs": int(body.get("topk_prompt_logprobs") or 0),
              "topk_sample_logprobs": int(body.get("topk_sample_logprobs") or 0),
              "prompt_alt_tokens_k": int(body.get("prompt_alt_tokens_k") or 0),
              "prompt_logprobs_last_n": body.get("prompt_logprobs_last_n"),
              "target_prompt_ids": target.ids if target is not None else None}
    try:
        params = SamplingParams(max_tokens=p.get("max_tokens") or 256, temperature=float(p.get("temperature", 1.0)),
                                top_p=float(p.get("top_p", 1.0)), top_k=int(p.get("top_k", -1)), stop=stop,
                                seed=p.get("seed"))
        return SampleRequest(prompt, params, num_samples=int(body.get("num_samples", 1)),
                             prompt_logprobs=bool(body.get("prompt_logprobs")), adapter=adapter, **extras)
    except (ValueError, TypeError) as e:  # EngineError: a parameter out of its range; or not a number
        raise HostError(str(e)) from None


def encode_sample(res, body: dict) -> tuple[bytes, int]:
    """A SampleResult as the SampleResponse its request (`body`, checked) gets, extras included."""
    from lockstep.service import sample_extras, wire

    seqs = [(s.tokens, s.logprobs, s.stop_reason) for s in res.sequences]
    msg = wire.sample_response(seqs, res.prompt_logprobs)
    target = None
    if res.target_prompt_logprobs is not None:  # a sparse request's layout is its response's
        target = sample_extras.checked_target(body, res.target_prompt_logprobs.shape[0] + 1)
    sample_extras.encode(msg, res, target)
    return msg.SerializeToString(), sum(len(s.tokens) for s in res.sequences)
