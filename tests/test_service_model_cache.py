"""The engine host's memory: one shared base per base model, a byte budget, eviction to spill
storage and exact rebuilds (service/host.py, service/models_cache.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from test_service_api import fwdbwd

LORA = {"rank": 4, "seed": 7}
"""The Tinker SDK's default LoRA: attention, MLP and lm_head (train_unembed), on the shared base."""
ADAM = {"learning_rate": 1e-2}
SAMPLE = {"num_samples": 2, "sampling_params": {"max_tokens": 6, "temperature": 1.0, "seed": 11}}


def make_host(tmp_path, name: str, **kw):
    from lockstep.service.host import EngineHost

    return EngineHost(str(tmp_path / name / "storage"), str(tmp_path / name / "cache"), 1, **kw)


def sizes(host, base_dir: str, model_id: str) -> tuple[int, int]:
    """(the shared base's bytes, one LoRA client's bytes) as the host counts them."""
    return host.models.entries[("base", base_dir)].nbytes, host.models.entries[("model", model_id)].nbytes


def tokens(i: int) -> tuple:
    return tuple(int(t) for t in np.random.default_rng(i).integers(4, 200, 12))


def moments(trainer) -> list[torch.Tensor]:
    per_param = [trainer.optimizer.state[p] for p in trainer.params.values()]
    return [s[k] for s in per_param for k in sorted(s) if torch.is_tensor(s[k])]


def test_lora_clients_and_sessions_share_one_base(tmp_path, builtin_dir):
    """Three LoRA clients (lm_head included, the SDK's default) and their sampling sessions run on one
    SharedBase; each client holds only its adapter (its count: weights, gradients and two AdamW
    moments); so does a LoRA without lm_head; only a full fine-tuning client keeps a copy of its own."""
    host = make_host(tmp_path, "h")
    for i in range(3):
        host.create_model(f"m{i}", builtin_dir, {**LORA, "seed": i})
        host.snapshot_session(f"m{i}", f"s{i}", f"snap/{i}", builtin_dir, LORA)
    (base,) = host.bases.values()
    assert all(t.base is base for t in host.trainers.values())
    assert all(s.adapter is not None and s.weights is None for s in host.sessions.values())
    base_bytes, client_bytes = sizes(host, builtin_dir, "m0")
    adapter = sum(p.numel() * 4 for p in host.trainers["m0"].params.values())
    weights = [*base.hf_model.parameters(), *base.hf_model.buffers()]
    assert client_bytes == 4 * adapter and base_bytes == sum(t.numel() * t.element_size() for t in weights)
    assert host.models.total == base_bytes + 3 * client_bytes + 3 * adapter  # three clients, three snapshots
    assert any("lm_head" in n for n in host.trainers["m0"].params)
    host.create_model("projections", builtin_dir, {**LORA, "train_unembed": False})
    host.create_model("full", builtin_dir, None)
    assert host.trainers["projections"].base is base and not hasattr(host.trainers["full"], "base")
    assert len(host.bases) == 1


def test_lora_clients_evicted_mid_step_continue_bit_for_bit(tmp_path, builtin_dir):
    """A budget that holds the base and one client, three clients in turn: each forward_backward
    evicts the previous client with its gradients pending, each optim_step with its Adam moments;
    sampling sessions are evicted too (max_sessions 1). Every response (losses, logprobs, sampled
    tokens and their logprobs, byte for byte) and the final weights and moments equal those of a
    host that never evicted."""
    free = make_host(tmp_path, "free")
    free.create_model("m0", builtin_dir, {**LORA, "seed": 0})
    base_bytes, client_bytes = sizes(free, builtin_dir, "m0")
    tight = make_host(tmp_path, "tight", model_cache_bytes=base_bytes + client_bytes * 3 // 2, max_sessions=1)
    ids = ("m0", "m1", "m2")
    replies = {}
    for name, host in (("free", free), ("tight", tight)):
        out = replies[name] = []
        for i, m in enumerate(ids):
            host.create_model(m, builtin_dir, {**LORA, "seed": i})
        for step in range(2):
            for micro in range(2):  # two forward_backward calls accumulate before the step
                for i, m in enumerate(ids):
                    out.append(host.forward_backward(m, fwdbwd(m, tokens=tokens(100 * step + 10 * micro + i)), False))
                    if host is tight and micro == 0:
                        prev = ids[i - 1] if i else None
                        assert prev is None or tight.spilled[prev].grads  # evicted with its gradients pending
            for m in ids:
                out.append(host.optim_step(m, ADAM))
        for m in ids:
            host.snapshot_session(m, f"s-{m}", f"snap/{m}", builtin_dir, LORA)
        for _ in range(2):
            for m in ids:  # the tight host reopens each session from storage, as the executor does
                if not host.has_session(f"s-{m}"):
                    assert host is tight
                    host.open_session(f"s-{m}", builtin_dir, LORA, f"snap/{m}")
                body = {**SAMPLE, "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]},
                        "prompt_logprobs": True}
                out.append(host.sample(f"s-{m}", body))
        for i, m in enumerate(ids):
            out.append(host.forward_backward(m, fwdbwd(m, tokens=tokens(1000 + i)), True))
    assert replies["tight"] == replies["free"]
    assert tight.models.total <= tight.models.budget and len(tight.trainers) == 1
    for m in ids:  # weights and moments after the rebuild, and the state it was rebuilt from
        a, b = free._trainer(m), tight._trainer(m)
        wa, wb = a.weights_numpy(), b.weights_numpy()
        assert wa.keys() == wb.keys() and all(np.array_equal(wa[k], wb[k]) for k in wa)
        assert all(torch.equal(x, y) for x, y in zip(moments(a), moments(b), strict=True)) and a.step == b.step == 2


def test_pending_gradients_survive_an_eviction(tmp_path, builtin_dir):
    """The control for the spill's gradients: forward_backward, evicted, optim_step. The step applies
    the gradients of the call before the eviction (weights move exactly as on a host that kept the
    client), not none."""
    free = make_host(tmp_path, "free")
    free.create_model("a", builtin_dir, LORA)
    base_bytes, client_bytes = sizes(free, builtin_dir, "a")
    tight = make_host(tmp_path, "tight", model_cache_bytes=base_bytes + client_bytes * 3 // 2)
    tight.create_model("a", builtin_dir, LORA)
    tight.create_model("b", builtin_dir, {**LORA, "seed": 8})
    free.create_model("b", builtin_dir, {**LORA, "seed": 8})
    for host in (free, tight):
        host.forward_backward("a", fwdbwd("a", tokens=tokens(1)), False)
        host.forward_backward("b", fwdbwd("b", tokens=tokens(2)), False)  # evicts a on the tight host
    assert "a" in tight.spilled and "a" not in tight.trainers
    before = free._trainer("a").weights_numpy()
    for host in (free, tight):
        host.optim_step("a", ADAM)
    wa, wb = free._trainer("a").weights_numpy(), tight._trainer("a").weights_numpy()
    assert all(np.array_equal(wa[k], wb[k]) for k in wa)
    assert not all(np.array_equal(wa[k], before[k]) for k in wa)  # the step did move the weights


def test_a_base_leaves_only_when_nothing_resident_uses_it(tmp_path, builtin_dir):
    """A full fine-tuning client that needs the room evicts the LoRA client first, then its base
    (nothing resident runs on it any more); the LoRA client's next request brings both back and
    evicts the full trainer, and it continues exactly."""
    free = make_host(tmp_path, "free")
    free.create_model("lora", builtin_dir, LORA)
    free.create_model("full", builtin_dir, None)
    base_bytes, client_bytes = sizes(free, builtin_dir, "lora")
    full_bytes = free.models.entries[("model", "full")].nbytes
    trainable = sum(p.numel() * 4 for p in free.trainers["full"].params.values())
    assert full_bytes == base_bytes + 3 * trainable  # its own model, gradients and two moments
    tight = make_host(tmp_path, "tight", model_cache_bytes=full_bytes + base_bytes // 2)
    tight.create_model("lora", builtin_dir, LORA)
    tight.create_model("full", builtin_dir, None)
    assert list(tight.bases) == [] and list(tight.trainers) == ["full"] and "lora" in tight.spilled
    tight.forward_backward("full", fwdbwd("full"), False)
    free.forward_backward("full", fwdbwd("full"), False)
    got = tight.forward_backward("lora", fwdbwd("lora"), True)
    assert list(tight.bases) == [builtin_dir] and list(tight.trainers) == ["lora"] and "full" in tight.spilled
    assert got == free.forward_backward("lora", fwdbwd("lora"), True)
    assert tight.optim_step("full", ADAM) == free.optim_step("full", ADAM)  # its pending gradients came back


def test_what_cannot_fit_the_whole_budget_is_refused_naming_it(tmp_path, builtin_dir):
    """A base larger than the budget, or a client that with its base exceeds it, is a HostError
    naming the budget and the flag that sets it, and leaves nothing held; smaller ones still work."""
    from lockstep.service.host import HostError

    free = make_host(tmp_path, "free")
    free.create_model("m", builtin_dir, LORA)
    base_bytes, client_bytes = sizes(free, builtin_dir, "m")
    small = make_host(tmp_path, "small", model_cache_bytes=base_bytes - 1)
    with pytest.raises(HostError, match=r"more than the worker's whole model cache budget of .* MiB.*--model-cache-mb"):
        small.create_model("m", builtin_dir, LORA)
    assert small.models.total == 0 and not small.has_model("m")
    mid = make_host(tmp_path, "mid", model_cache_bytes=base_bytes + client_bytes)
    with pytest.raises(HostError, match="model cache budget"):
        mid.create_model("full", builtin_dir, None)  # four times the base
    assert not mid.has_model("full")
    mid.create_model("m", builtin_dir, LORA)  # base + one client fits exactly
    mid.forward_backward("m", fwdbwd("m"), False)
    assert mid.models.total == base_bytes + client_bytes


def test_max_models_still_caps_the_count(tmp_path, builtin_dir):
    """The older count limits hold beside the bytes: max_models 2 keeps the two newest clients and
    spills the oldest, which comes back on its next request."""
    host = make_host(tmp_path, "h", max_models=2)
    for i in range(3):
        host.create_model(f"m{i}", builtin_dir, {**LORA, "seed": i})
    assert list(host.trainers) == ["m1", "m2"] and host.has_model("m0") and "m0" in host.spilled
    host.forward_backward("m0", fwdbwd("m0"), True)
    assert list(host.trainers) == ["m2", "m0"] and "m1" in host.spilled and "m0" not in host.spilled
    host.drop_model("m1")
    assert not host.has_model("m1") and not any((tmp_path / "h" / "cache" / "spill").rglob("MANIFEST.json"))
