"""A packed batch runs as one engine call (service/host_batches.py): EngineHost.run_batch hands the
members on one shared base to ONE packed_forward(_backward) or Sampler.sample call, and every member's
response bytes equal those of the same request run alone on a fresh host. Hostile members fail
alone; private models and sessions run alone beside the packed call."""

from __future__ import annotations

import numpy as np
import pytest
from test_service_batches import executor_and_api  # noqa: F401 - a fixture

from lockstep.service import wire
from lockstep.service.types import BatchMember

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")

LORAS = {  # different ranks, targets and seeds: all on the shared base
    "a": {"rank": 2, "seed": 1, "train_unembed": False},
    "b": {"rank": 4, "seed": 2, "train_unembed": False, "train_mlp": False},
    "c": {"rank": 8, "seed": 3, "train_unembed": False, "train_attn": False},
    "d": {"rank": 4, "seed": 4, "train_unembed": False},
    "e": {"rank": 4, "seed": 6},  # the SDK's default (train_unembed): lm_head too, on the shared base
}
PRIVATE = {"p": {"rank": 0}}
"""A full fine-tune (rank 0): a private copy of the model, which runs alone."""
ADAM = {"learning_rate": 1e-2}


def make_host(tmp_path, name: str, **kw):
    from lockstep.service.host import EngineHost

    return EngineHost(str(tmp_path / name / "storage"), str(tmp_path / name / "cache"), 1, **kw)


def fb_request(model_id: str, i: int, *, weights=None) -> bytes:
    """A forward_backward body of two or three datums of different lengths (seeded by i)."""
    rng = np.random.default_rng(i)
    data = []
    for n in rng.integers(3, 14, 2 + i % 2):
        tokens = tuple(int(t) for t in rng.integers(4, 200, n))
        w = np.asarray(weights if weights is not None else rng.random(n), np.float32)[:n]
        data.append(wire.WireDatum(tokens, {"target_tokens": rng.integers(4, 200, n).astype(np.int64), "weights": w}))
    return wire.encode_forward_backward(wire.FwdBwd(model_id, 1, tuple(data), "cross_entropy", {}, False))


class Calls:
    """Counts calls of an engine function and the groups or requests each carried."""

    def __init__(self, monkeypatch, owner, name: str):
        self.sizes: list[int] = []
        real = getattr(owner, name)

        def wrapper(*args):
            self.sizes.append(len(args[-1]))
            return real(*args)

        monkeypatch.setattr(owner, name, wrapper)


def alone(tmp_path, builtin_dir, mid: str, lora: dict, steps) -> tuple[list, dict]:
    """(responses, final weights) of one model's requests on a fresh host, each batch of one."""
    host = make_host(tmp_path, f"alone-{mid}")
    host.create_model(mid, builtin_dir, lora)
    out = []
    for kind, body in steps:
        if kind == "optim_step":
            host.optim_step(mid, ADAM)
            continue
        [r] = host.run_batch(kind, [BatchMember(mid, body)])
        out.append(r if not isinstance(r, Exception) else ("error", str(r)))
    return out, host._trainer(mid).weights_numpy()


def test_a_mixed_training_batch_is_one_packed_call_with_the_alone_bytes(tmp_path, builtin_dir, monkeypatch):
    """Five LoRA clients (ranks 2-8, attention, MLP or both, one with lm_head too) and a full
    fine-tune (private copy): forward_backward, optim_step, forward. The five shared ones go through
    ONE packed_forward_backward and ONE packed_forward call; the private one alone. Every response's
    bytes and every model's weights after the step equal those of the model alone on a fresh host."""
    from lockstep.engine import packed

    models = {**LORAS, **PRIVATE}
    host = make_host(tmp_path, "packed")
    for mid, lora in models.items():
        host.create_model(mid, builtin_dir, lora)
    fb_calls = Calls(monkeypatch, packed, "packed_forward_backward")
    fwd_calls = Calls(monkeypatch, packed, "packed_forward")
    steps = {mid: [("forward_backward", fb_request(mid, i)), ("optim_step", None), ("forward", fb_request(mid, 10 + i))]
             for i, mid in enumerate(models)}
    got = {mid: [] for mid in models}
    for s in range(3):
        kind = steps["a"][s][0]
        if kind == "optim_step":
            for mid in models:
                host.optim_step(mid, ADAM)
            continue
        results = host.run_batch(kind, [BatchMember(mid, steps[mid][s][1]) for mid in models])
        for mid, r in zip(models, results):
            assert not isinstance(r, Exception), r
            got[mid].append(r)
    # one packed call of the five shared models each time (the private one ran alone, not packed)
    assert fb_calls.sizes == [5] and fwd_calls.sizes == [5]
    assert host.batch_stats["train_calls"] == 2 and host.batch_stats["train_packed_members"] == 10
    monkeypatch.undo()
    for mid, lora in models.items():
        responses, weights = alone(tmp_path, builtin_dir, mid, lora, steps[mid])
        assert got[mid] == responses, mid
        mine = host._trainer(mid).weights_numpy()
        assert mine.keys() == weights.keys() and all(np.array_equal(mine[k], weights[k]) for k in mine), mid


def test_a_hostile_member_fails_alone_inside_the_packed_call(tmp_path, builtin_dir, monkeypatch):
    """In one forward_backward batch with three honest clients: one member whose weights overflow
    the loss to inf (finite inputs, so only the engine sees it: its group fails inside the packed
    call), one with a token id out of range, one with NaN weights (both refused by the check). Each
    fails alone with the message it gets alone and its gradients untouched; the honest members'
    bytes and gradients equal their alone ones."""
    from lockstep.engine import packed

    host = make_host(tmp_path, "packed")
    honest = ("a", "b", "c")
    hostile = {"inf": fb_request("inf", 7, weights=[3e38] * 14),
               "oov": wire.encode_forward_backward(wire.FwdBwd("oov", 1, (wire.WireDatum(
                   (5, 10**6), {"target_tokens": np.asarray([5, 6]), "weights": np.ones(2, np.float32)}),),
                   "cross_entropy", {}, False)),
               "nan": fb_request("nan", 8, weights=[float("nan")] * 14)}
    for mid in (*honest, *hostile):
        host.create_model(mid, builtin_dir, LORAS.get(mid, LORAS["d"]))
    calls = Calls(monkeypatch, packed, "packed_forward_backward")
    members = [BatchMember("inf", hostile["inf"]), BatchMember("a", fb_request("a", 0)),
               BatchMember("oov", hostile["oov"]), BatchMember("b", fb_request("b", 1)),
               BatchMember("nan", hostile["nan"]), BatchMember("c", fb_request("c", 2))]
    results = dict(zip([m.key for m in members], host.run_batch("forward_backward", members)))
    assert calls.sizes == [4]  # inf went into the packed call with the honest three; oov and nan were refused first
    assert "loss is inf" in str(results["inf"]) and "outside the vocabulary" in str(results["oov"])
    assert "NaN or inf" in str(results["nan"])
    monkeypatch.undo()
    for mid in hostile:  # the message it gets alone; nothing of it touched its gradients
        assert ("error", str(results[mid])) == alone(tmp_path, builtin_dir, mid, LORAS["d"],
                                                     [("forward_backward", hostile[mid])])[0][0]
        assert all(p.grad is None for p in host._trainer(mid).params.values())
    for i, mid in enumerate(honest):
        responses, _ = alone(tmp_path, builtin_dir, mid, LORAS[mid], [("forward_backward", fb_request(mid, i))])
        assert results[mid] == responses[0]
        assert any(p.grad is not None and p.grad.any() for p in host._trainer(mid).params.values())


# -- sampling ------------------------------------------------------------------------------------
def sample_body(i: int, **extra) -> dict:
    rng = np.random.default_rng(100 + i)
    prompt = [int(t) for t in rng.integers(4, 200, 4 + i % 4)]
    body = {"prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]}, "num_samples": 1 + i % 3,
            "prompt_logprobs": bool(i % 2),
            "sampling_params": {"max_tokens": 4 + i % 5, "temperature": 1.0, "seed": 1000 + i, **extra}}
    if i % 2:  # every other member asks for the sampling extras too, each its own widths
        body.update(topk_prompt_logprobs=1 + i % 3, topk_sample_logprobs=2 + i % 2, prompt_alt_tokens_k=2,
                    prompt_logprobs_last_n=2, target_prompt_logprobs={
                        "data": [5 + r if r % 2 else -1 for r in range(len(prompt) - 1)], "dtype": "int64",
                        "shape": [len(prompt) - 1, 1]})
    return body


def open_sessions(host, builtin_dir, models: dict) -> None:
    """Each model trained one step, then a sampling session on its weights; and one on the bare base."""
    for mid, lora in models.items():
        host.create_model(mid, builtin_dir, lora)
        host.forward_backward(mid, fb_request(mid, ord(mid)), False)
        host.optim_step(mid, ADAM)
        host.snapshot_session(mid, f"s-{mid}", f"snap/{mid}", builtin_dir, lora)
    host.open_session("s-bare", builtin_dir, None, None)


def sample_alone(tmp_path, builtin_dir, mid: str, lora: dict | None, body: dict):
    host = make_host(tmp_path, f"alone-s-{mid}-{len(list(tmp_path.iterdir()))}")
    open_sessions(host, builtin_dir, {} if lora is None else {mid: lora})
    [r] = host.run_batch("sample", [BatchMember(f"s-{mid}", body)])
    return ("error", str(r)) if isinstance(r, Exception) else r


def test_a_mixed_sampling_batch_is_one_sampler_call_with_the_alone_bytes(tmp_path, builtin_dir, monkeypatch):
    """Five LoRA sessions (one with lm_head), the bare base and a full fine-tune's session (a private
    skeleton) sample seeded requests of different prompts, lengths, num_samples and prompt_logprobs
    in one batch; a hostile member asks for a stop token out of range and another for top_p 5. The six shared
    ones go through ONE Sampler.sample call; each member's bytes (tokens, logprobs, prompt
    logprobs) equal its alone ones; the hostile members fail alone with their alone messages.
    The control: the same hostile request in one sampler call with the others fails them all."""
    from lockstep.engine.sampler import Sampler

    models = {**LORAS, **PRIVATE}
    host = make_host(tmp_path, "packed")
    open_sessions(host, builtin_dir, models)
    keys = [*models, "bare"]
    bodies = {mid: sample_body(i) for i, mid in enumerate(keys)}
    bad = {"a": sample_body(20, stop=[10**6]), "b": sample_body(21, top_p=5.0)}
    calls = Calls(monkeypatch, Sampler, "sample")
    members = [BatchMember(f"s-{mid}", body) for mid, body in bodies.items()]
    members.insert(2, BatchMember("s-a", bad["a"]))  # a session may have several requests in one batch
    members.append(BatchMember("s-b", bad["b"]))
    results = host.run_batch("sample", members)
    assert sorted(calls.sizes) == [1, 6]  # the private session alone; the six shared ones in one call
    assert host.batch_stats["sample_calls"] == 1 and host.batch_stats["sample_packed_members"] == 6
    assert "stop" in str(results[2]) and "outside the vocabulary" in str(results[2])
    assert "top_p" in str(results[-1])
    monkeypatch.undo()
    got = dict(zip(keys, results[:2] + results[3:-1]))
    for mid in keys:
        lora = None if mid == "bare" else models[mid]
        assert got[mid] == sample_alone(tmp_path, builtin_dir, mid, lora, bodies[mid]), mid
    for (mid, body), r in zip(bad.items(), (results[2], results[-1])):
        assert ("error", str(r)) == sample_alone(tmp_path, builtin_dir, mid, models[mid], body)
    # control: without the per-request check, the stop id out of range refuses the whole call
    from lockstep.engine.types import EngineError
    from lockstep.service.host_batches import sample_request

    base = host.bases[builtin_dir]
    together = [sample_request(bodies["c"], host.sessions["s-c"].adapter), sample_request(bad["a"], None)]
    with pytest.raises(EngineError, match="request 1 stop"):
        Sampler(base.model, base.tokenizer).sample(together)


def test_a_packed_sampling_call_that_fails_reruns_each_member_alone(tmp_path, builtin_dir, monkeypatch):
    """A failure the per-request checks cannot see (injected: any call holding the marked prompt
    raises): the packed call fails, each member runs again alone; only the marked one fails, and the
    others' bytes are those of the clean packed call."""
    from lockstep.engine.sampler import Sampler
    from lockstep.engine.types import EngineError

    host = make_host(tmp_path, "packed")
    open_sessions(host, builtin_dir, LORAS)
    bodies = {mid: sample_body(i) for i, mid in enumerate(LORAS)}
    clean = host.run_batch("sample", [BatchMember(f"s-{m}", b) for m, b in bodies.items()])
    marked = sample_body(2)  # the same size class as the others: it joins their call
    marked["prompt"]["chunks"][0]["tokens"] = [9, 9, 9, 9, 9]
    real = Sampler.sample

    def failing(self, requests, **kw):
        if any(r.prompt == (9, 9, 9, 9, 9) for r in requests):
            raise EngineError("injected failure")
        return real(self, requests, **kw)

    monkeypatch.setattr(Sampler, "sample", failing)
    results = host.run_batch("sample", [BatchMember(f"s-{m}", b) for m, b in bodies.items()]
                             + [BatchMember("s-a", marked)])
    assert host.batch_stats["sample_calls"] == 2  # the clean call and the failed one were packed
    assert results[:-1] == clean
    assert "injected failure" in str(results[-1]) and type(results[-1]).__name__ == "HostError"


def test_a_batch_s_models_stay_resident_under_memory_pressure(tmp_path, builtin_dir, monkeypatch):
    """A budget that holds the base and about one client, three clients spilled: readying each
    member rebuilds it, which would evict the one before; pinned, all three stay for the batch and
    go through ONE packed call, with the bytes of a host that never evicted. Afterwards the host is
    back under its budget."""
    from lockstep.engine import packed

    free = make_host(tmp_path, "free")
    free.create_model("a", builtin_dir, LORAS["a"])
    base_bytes, client_bytes = (free.models.entries[k].nbytes for k in (("base", builtin_dir), ("model", "a")))
    tight = make_host(tmp_path, "tight", model_cache_bytes=base_bytes + client_bytes * 3 // 2)
    mids = ("a", "b", "d")  # same-size clients (c's rank 8 would not fit the budget alone)
    for host in (free, tight):
        for mid in mids:
            host.create_model(mid, builtin_dir, {**LORAS["a"], "seed": ord(mid)})
    assert len(tight.spilled) == 2
    calls = Calls(monkeypatch, packed, "packed_forward_backward")
    members = [BatchMember(mid, fb_request(mid, i)) for i, mid in enumerate(mids)]
    got = tight.run_batch("forward_backward", members)
    assert calls.sizes == [3]
    assert tight.models.total <= tight.models.budget and len(tight.spilled) == 2
    monkeypatch.undo()
    assert got == free.run_batch("forward_backward", members)
    for mid in mids:  # the gradients went with each spill: the next step is the same
        free.optim_step(mid, ADAM)
        tight.optim_step(mid, ADAM)
        wa, wb = free._trainer(mid).weights_numpy(), tight._trainer(mid).weights_numpy()
        assert all(np.array_equal(wa[k], wb[k]) for k in wa), mid



def test_the_executor_runs_a_claimed_batch_as_one_packed_call(request, builtin_dir, monkeypatch, tmp_path):
    """Through the API, the store and a real Executor: three tenants' shared-base LoRA clients each
    queue a forward_backward; the Executor claims them as one batch and the host runs ONE
    packed_forward_backward; each stored result is the bytes of its request alone on a fresh host."""
    from test_service_api import post
    from test_service_batches import drain, post_fb, row

    from lockstep.engine import packed

    ex, client, sessions, key_a, key_b = request.getfixturevalue("executor_and_api")
    lora = {"rank": 4, "seed": 3, "train_unembed": False}
    mids = []
    for key in (key_a, key_b, key_a):
        sid = post(client, "create_session", key, {"tags": [], "sdk_version": "0.38.0"}).json()["session_id"]
        r = post(client, "create_model", key, {"session_id": sid, "model_seq_id": 0, "base_model": "lockstep/tiny",
                                               "lora_config": lora})
        assert r.status_code == 200, r.text
        mids.append(r.json()["model_id"])
    drain(ex)
    toks = {mid: tuple(range(5 + i, 12 + 2 * i)) for i, mid in enumerate(mids)}
    rids = {mid: post_fb(client, key, mid, 1, toks[mid]) for mid, key in zip(mids, (key_a, key_b, key_a))}
    calls = Calls(monkeypatch, packed, "packed_forward_backward")
    with sessions() as s:
        claim = ex.packer.claim(s, ex.id)
    assert {m.id for m in claim.members} == set(rids.values())
    ex.run(claim)
    assert calls.sizes == [3]
    monkeypatch.undo()
    from test_service_api import fwdbwd

    for mid, rid in rids.items():
        done = row(sessions, rid)
        assert done.state == "done", done.error
        fresh = make_host(tmp_path, f"fresh-{mid}")
        fresh.create_model(mid, builtin_dir, lora)
        assert done.result == fresh.forward_backward(mid, fwdbwd(mid, 1, tokens=toks[mid]), False)[0]


def test_default_sdk_lora_clients_share_the_base_with_their_private_copies_bytes(tmp_path, builtin_dir, monkeypatch):
    """Three clients with the Tinker SDK's default LoRA (train_unembed=True: every projection and
    lm_head; ranks 2-8) hold only their adapters on the shared base: the host's cache holds one
    base and an adapter-sized entry per client, no copy of the model. Packed, their forward_backward,
    forward and sampling responses and their weights after optim_step are the bytes each got before
    lm_head was shareable: a private peft copy of the model per client (shares_base forced false),
    each alone on its own host."""
    from lockstep.service import host as host_mod

    defaults = {mid: {"rank": rank, "seed": i} for i, (mid, rank) in enumerate((("x", 4), ("y", 8), ("z", 2)))}
    shared = make_host(tmp_path, "shared")
    for mid, lora in defaults.items():
        shared.create_model(mid, builtin_dir, lora)
    (base,) = shared.bases.values()
    assert all(t.base is base and any("lm_head" in n for n in t.params) for t in shared.trainers.values())
    held = {k: e.nbytes for k, e in shared.models.entries.items()}
    adapters = {mid: sum(p.numel() * 4 for p in t.params.values()) for mid, t in shared.trainers.items()}
    model_bytes = sum(t.numel() * t.element_size() for t in (*base.hf_model.parameters(), *base.hf_model.buffers()))
    assert held == {("base", builtin_dir): model_bytes, **{("model", m): 4 * adapters[m] for m in defaults}}
    assert all(4 * a < model_bytes for a in adapters.values())

    def run(host, mids):
        """forward_backward, optim_step, forward, then a snapshot's sampling: each batch of `mids`."""
        out = {m: [] for m in mids}
        for kind, seed in (("forward_backward", 0), ("optim_step", None), ("forward", 10)):
            if kind == "optim_step":
                for m in mids:
                    host.optim_step(m, ADAM)
                continue
            for m, r in zip(mids, host.run_batch(kind, [BatchMember(m, fb_request(m, seed + ord(m))) for m in mids])):
                out[m].append(r)
        for m in mids:
            host.snapshot_session(m, f"s-{m}", f"snap/{m}", builtin_dir, defaults[m])
        bodies = [BatchMember(f"s-{m}", sample_body(ord(m) % 7)) for m in mids]
        for m, r in zip(mids, host.run_batch("sample", bodies)):
            out[m].append(r)
        return out

    got = run(shared, list(defaults))
    assert shared.batch_stats["train_packed_members"] == 6 and shared.batch_stats["sample_packed_members"] == 3
    assert not any(isinstance(r, Exception) for rs in got.values() for r in rs), got
    monkeypatch.setattr(host_mod, "shares_base", lambda spec: False)  # the host before: a peft copy each
    for mid, lora in defaults.items():
        private = make_host(tmp_path, f"private-{mid}")
        private.create_model(mid, builtin_dir, lora)
        assert not hasattr(private._trainer(mid), "base") and not private.bases
        assert got[mid] == run(private, [mid])[mid], mid
        mine, theirs = shared._trainer(mid).weights_numpy(), private._trainer(mid).weights_numpy()
        assert mine.keys() == theirs.keys() and all(np.array_equal(mine[k], theirs[k]) for k in mine), mid
