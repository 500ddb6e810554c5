"""Wrong numbers are refused, not trained on: an optimizer or loss hyperparameter out of its range,
and a loss called without an input it needs, is a 400 naming the field and its range (or the
missing key) before anything is stored; the worker refuses the same payloads when the API is
bypassed; a refused request leaves the model as it was. Before this, learning_rate=1e30 (or
eps=0) was trained on and left the model NaN for good, and importance_sampling without
`logprobs` trained against logprobs of 0."""

import dataclasses
import json
import math

import numpy as np
import pytest
import tinker
import torch
from sqlalchemy import select
from tinker import types

from lockstep.service import wire
from lockstep.service.tenants import create_tenant
from service_fuzzing import in_process_service
from test_service_api import new_model, post, serving
from test_service_policy import call as v1_call, num_jobs, svc  # noqa: F401 - svc is a fixture
from test_service_sdk import sft_datum

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")

BAD_ADAM = [
    ("learning_rate", 1e30, "[0, 1]"), ("learning_rate", 2.0, "[0, 1]"), ("learning_rate", -1e-4, "[0, 1]"),
    ("learning_rate", math.nan, "[0, 1]"), ("beta1", 1.0, "[0, 1)"), ("beta1", -0.1, "[0, 1)"),
    ("beta2", 1.0, "[0, 1)"), ("beta2", 1e30, "[0, 1)"), ("eps", 0.0, "[1e-20, 1]"), ("eps", 1e-300, "[1e-20, 1]"),
    ("eps", 10.0, "[1e-20, 1]"), ("eps", math.inf, "[1e-20, 1]"), ("weight_decay", -0.1, "[0, 10]"),
    ("weight_decay", 1e30, "[0, 10]"), ("grad_clip_norm", -1.0, "[0, 1e6]"), ("grad_clip_norm", 1e30, "[0, 1e6]"),
]
"""(field, value, the range the 400 names): each alone in an otherwise default AdamParams."""

SANE_ADAM = [{"learning_rate": 0.0}, {"learning_rate": 1e-1}, {"learning_rate": 1e-7}, {"beta1": 0.0},
             {"beta2": 0.999}, {"eps": 1e-8}, {"eps": 1e-16}, {"weight_decay": 0.1},
             {"weight_decay": 5.0, "learning_rate": 1e-3}, {"grad_clip_norm": 1.0}, {"grad_clip_norm": 1000.0}]
"""Values recipes use: all accepted."""

BAD_LOSS_CONFIG = [
    ("ppo", {"clip_low_threshold": 1.5}, "'clip_low_threshold'", "[0, 1]"),
    ("cispo", {"clip_low_threshold": -0.2}, "'clip_low_threshold'", "[0, 1]"),
    ("ppo", {"clip_high_threshold": 0.5}, "'clip_high_threshold'", "[1, 1e6]"),
    ("gspo", {"clip_high_threshold": 1e30}, "'clip_high_threshold'", "[1, 1e6]"),
    ("dro", {"beta": -1.0}, "'beta'", "[0, 1000]"),
    ("dro", {"beta": 1e30}, "'beta'", "[0, 1000]"),
    ("importance_sampling", {"tis_cap": 0.0}, "'tis_cap'", "(0, 1e6]"),
    ("importance_sampling", {"tis_cap": 1e30}, "'tis_cap'", "(0, 1e6]"),
    ("ppo", {"mis_low": 1.5}, "'mis_low'", "[0, 1]"),
    ("cispo", {"mis_high": 0.5}, "'mis_high'", "[1, 1e6]"),
    ("importance_sampling", {"mis_low": 1.0, "mis_high": 1.0}, "'mis_low' must be below 'mis_high'", ""),
]
"""(loss, loss_fn_config, what the 400 names, the range it names)."""

NEEDS = {"cross_entropy": (), "importance_sampling": ("logprobs", "advantages"), "ppo": ("logprobs", "advantages"),
         "cispo": ("logprobs", "advantages"), "dro": ("logprobs", "advantages"),
         "gspo": ("logprobs", "advantages", "sequence_ratio_mask")}
"""What each loss needs besides target_tokens, from Tinker's loss table (tinker_protocol.md §7):
none of these has a documented default (cross_entropy's weights do: ones)."""
MISSING = [(loss, key) for loss, keys in NEEDS.items() for key in ("target_tokens", *keys)]


def inputs_for(loss: str, n: int = 3, without: str = "") -> dict:
    """A datum's loss_fn_inputs for `loss` over n tokens: everything it needs, less `without`."""
    arrays = {"target_tokens": np.asarray([6, 7, 8][:n], np.int64), "logprobs": np.full(n, -1.0, np.float32),
              "advantages": np.asarray([0.0, 1.0, -1.0][:n], np.float32),
              "sequence_ratio_mask": np.asarray([0.0, 1.0, 1.0][:n], np.float32)}
    keys = ("target_tokens", *NEEDS[loss])
    return {k: arrays[k] for k in keys if k != without}


def fwdbwd(model_id: str, loss: str, inputs, config=None, seq_id: int = 1) -> bytes:
    """A ForwardBackwardRequest of one datum per entry of `inputs` (a dict or a list of dicts)."""
    per_datum = inputs if isinstance(inputs, list) else [inputs]
    data = tuple(wire.WireDatum((5, 6, 7), d) for d in per_datum)
    return wire.encode_forward_backward(wire.FwdBwd(model_id, seq_id, data, loss, config or {}, False))


PROTO = "application/x-protobuf"


@pytest.fixture(scope="module")
def api(tmp_path_factory, builtin_dir):
    from lockstep.service.db import Tenant

    with serving(tmp_path_factory.mktemp("hyper"), builtin_dir) as (client, sessions, key, _):
        with sessions() as s:  # a fresh model per case (each case's seq_id 1), past the default quota
            for tenant in s.scalars(select(Tenant)):
                tenant.max_models = 1000
            s.commit()
        yield client, sessions, key


def error_of(r) -> str:
    assert r.status_code == 400, r.text
    assert r.json()["category"] == "user", r.text
    return r.json()["error"]


# -- the API: optimizer ------------------------------------------------------------------------------
@pytest.mark.parametrize("field, value, bounds", BAD_ADAM)
def test_an_adam_param_out_of_range_is_a_400_naming_it_and_its_range(api, field, value, bounds):
    client, _, key = api
    _, mid = new_model(client, key)
    body = json.dumps({"model_id": mid, "seq_id": 1, "adam_params": {field: value}})  # NaN as Python's json sends it
    error = error_of(client.post("/api/v1/optim_step", content=body,
                                 headers={"X-API-Key": key, "Content-Type": "application/json"}))
    assert f"adam_params/{field}" in error and f"must be a number in {bounds}" in error, error


@pytest.mark.parametrize("params", SANE_ADAM)
def test_every_sane_adam_param_is_accepted(api, params):
    client, _, key = api
    _, mid = new_model(client, key)
    r = post(client, "optim_step", key, {"model_id": mid, "seq_id": 1, "adam_params": params})
    assert r.status_code == 200, r.text


def test_a_decay_that_flips_the_weights_sign_is_refused(api):
    """lr 0.5 and weight_decay 5 are each in range; together each step scales every weight by -1.5."""
    client, _, key = api
    _, mid = new_model(client, key)
    error = error_of(post(client, "optim_step", key, {"model_id": mid, "seq_id": 1,
                                                      "adam_params": {"learning_rate": 0.5, "weight_decay": 5.0}}))
    assert "learning_rate x weight_decay must be at most 1" in error, error


def test_another_optimizer_is_refused_not_trained_as_adam(api):
    """SDK 0.38 sends a Dimuon step as optimizer_params and names the optimizer at creation: both
    were ignored (the step ran as Adam with default numbers)."""
    client, _, key = api
    sid, mid = new_model(client, key)
    error = error_of(post(client, "optim_step", key, {"model_id": mid, "seq_id": 1,
                                                      "optimizer_params": {"type": "dimuon", "learning_rate": 0.02}}))
    assert "optimizer_params" in error and "AdamW" in error, error
    body = {"session_id": sid, "model_seq_id": 5, "base_model": "lockstep/tiny", "optimizer_config": {"type": "dimuon"}}
    assert "optimizer_config/type" in error_of(post(client, "create_model", key, body))
    body["optimizer_config"] = {"type": "adamw"}
    assert post(client, "create_model", key, body).status_code == 200


# -- the API: losses ---------------------------------------------------------------------------------
@pytest.mark.parametrize("loss, config, names, bounds", BAD_LOSS_CONFIG)
def test_a_loss_config_value_out_of_range_is_a_400_naming_it(api, loss, config, names, bounds):
    client, _, key = api
    _, mid = new_model(client, key)
    r = client.post("/api/v1/forward_backward", content=fwdbwd(mid, loss, inputs_for(loss), config),
                    headers={"X-API-Key": key, "Content-Type": PROTO})
    error = error_of(r)
    assert names in error and bounds in error, error


@pytest.mark.parametrize("loss, key", MISSING)
def test_a_loss_without_an_input_it_needs_is_a_400_naming_the_key(api, loss, key):
    client, _, api_key = api
    _, mid = new_model(client, api_key)
    headers = {"X-API-Key": api_key, "Content-Type": PROTO}
    error = error_of(client.post("/api/v1/forward_backward", content=fwdbwd(mid, loss, inputs_for(loss, without=key)),
                                 headers=headers))
    names = key if key == "target_tokens" else f"loss {loss!r} needs loss_fn_inputs[{key!r}]"
    assert names in error, error
    # the control: the same request with the key is accepted
    ok = client.post("/api/v1/forward_backward", content=fwdbwd(mid, loss, inputs_for(loss), seq_id=2), headers=headers)
    assert ok.status_code == 200, ok.text


def test_optional_inputs_stay_optional_and_a_correction_needs_logprobs(api):
    client, _, key = api
    _, mid = new_model(client, key)
    headers = {"X-API-Key": key, "Content-Type": PROTO}
    targets = {"target_tokens": np.asarray([6, 7, 8], np.int64)}
    # cross_entropy without weights: they default to ones (Tinker's documented leniency)
    assert client.post("/api/v1/forward_backward", content=fwdbwd(mid, "cross_entropy", targets),
                       headers=headers).status_code == 200
    # a TIS cap weighs by exp(lp - logprobs): without logprobs it would weigh against 0
    error = error_of(client.post("/api/v1/forward_backward", content=fwdbwd(mid, "cross_entropy", targets,
                                                                             {"tis_cap": 2.0}, seq_id=2),
                                 headers=headers))
    assert "needs loss_fn_inputs['logprobs']" in error and "tis_cap" in error, error
    # a per-token clip floor on one datum only: the other would get a floor of 0, not the config's
    with_floor = {**inputs_for("ppo"), "clip_low_threshold": np.full(3, 0.9, np.float32)}
    error = error_of(client.post("/api/v1/forward_backward", content=fwdbwd(mid, "ppo", [with_floor, inputs_for("ppo")],
                                                                             seq_id=3), headers=headers))
    assert "datum 1: loss_fn_inputs['clip_low_threshold'] is missing but datum 0 has it" in error, error


# -- the job path ------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec, names", [
    ({"stages": [{"kind": "rl", "learning_rate": 1e30}]}, "learning_rate must be a number in (0, 1)"),
    ({"stages": [{"kind": "sft", "learning_rate": 0.0}]}, "learning_rate must be a number in (0, 1)"),
    ({"stages": [{"kind": "rl", "loss": "dro", "loss_config": {"beta": 1e30}}]},
     "'beta' must be a number in [0, 1000]"),
    ({"stages": [{"kind": "rl", "loss": "ppo", "loss_config": {"clip_low_threshold": 1.2}}]},
     "'clip_low_threshold' must be a number in [0, 1]"),
    ({"stages": [{"kind": "rl", "truncated_reward": 1e300}]}, "truncated_reward must be a number in [-1e6, 1e6]"),
    ({"model": {"lora_rank": 8, "lora_alpha": 1e30}}, "model.lora_alpha must be a number in (0, 10000]"),
])
def test_a_job_spec_hyperparameter_out_of_range_is_a_400_and_no_job(svc, spec, names):  # noqa: F811 - the fixture
    r = v1_call(svc, "alice", "POST", "jobs", json={"spec": spec})
    assert names in error_of(r)
    assert num_jobs(svc) == 0


# -- the worker, with the API bypassed ----------------------------------------------------------------
@pytest.fixture(scope="module")
def host(tmp_path_factory, builtin_dir):
    from lockstep.service.host import EngineHost

    tmp = tmp_path_factory.mktemp("host")
    host = EngineHost(str(tmp / "storage"), str(tmp / "cache"), 1)
    host.create_model("m", builtin_dir, {"rank": 4, "seed": 0})
    return host


def state(host) -> tuple[dict, dict]:
    trainer = host.trainers["m"]
    grads = {n: p.grad.clone() for n, p in trainer.params.items() if p.grad is not None}
    return trainer.weights_numpy(), grads


def same(a: tuple[dict, dict], b: tuple[dict, dict]) -> bool:
    (wa, ga), (wb, gb) = a, b
    return (wa.keys() == wb.keys() and all(np.array_equal(wa[k], wb[k]) for k in wa)
            and ga.keys() == gb.keys() and all(torch.equal(ga[k], gb[k]) for k in ga))


def test_the_worker_refuses_out_of_range_numbers_and_keeps_the_model(host):
    from lockstep.service.host import HostError

    host.forward_backward("m", fwdbwd("m", "cross_entropy", inputs_for("cross_entropy")), False)  # gradients to apply
    before = state(host)
    for field, value, bounds in BAD_ADAM:
        with pytest.raises(HostError, match=rf"adam_params\.{field} must be a number in {bounds}".replace("[", r"\[")
                           .replace("(", r"\(").replace(")", r"\)")):
            host.optim_step("m", {field: value})
    with pytest.raises(HostError, match="learning_rate x weight_decay"):
        host.optim_step("m", {"learning_rate": 0.5, "weight_decay": 5.0})
    with pytest.raises(HostError, match="must be a number in"):
        host.optim_step("m", {"learning_rate": "1e-3"})
    for loss, config, names, bounds in BAD_LOSS_CONFIG:
        with pytest.raises(HostError, match=names.split()[0].strip("'")) as info:
            host.forward_backward("m", fwdbwd("m", loss, inputs_for(loss), config), False)
        assert bounds in str(info.value)
    assert same(state(host), before)  # nothing applied, nothing accumulated, nothing cleared


@pytest.mark.parametrize("loss, key", [(loss, key) for loss, key in MISSING if key != "target_tokens"])
def test_the_worker_refuses_a_loss_without_an_input_it_needs(host, loss, key):
    from lockstep.service.host import HostError

    before = state(host)
    with pytest.raises(HostError, match=rf"datum 0: loss '{loss}' needs loss_fn_inputs\['{key}'\]"):
        host.forward_backward("m", fwdbwd("m", loss, inputs_for(loss, without=key)), False)
    with pytest.raises(HostError, match=rf"loss_fn_inputs\['{key}'\]"):  # forward-only answers the same
        host.forward_backward("m", fwdbwd("m", loss, inputs_for(loss, without=key)), True)
    assert same(state(host), before)


def unchecked(adam, **values):
    """An AdamParams built past its own check: what the trainer got before the ranges."""
    params = object.__new__(type(adam))
    for f in dataclasses.fields(adam):
        object.__setattr__(params, f.name, values.get(f.name, getattr(adam, f.name)))
    return params


@pytest.mark.parametrize("values", [{"learning_rate": 1e30}, {"eps": 0.0}])
def test_control_these_numbers_leave_a_model_nan_for_good_when_trained_on(builtin_dir, values):
    """The attack without the defence: the same trainer, handed the numbers the ranges refuse,
    ends with NaN logprobs that later good steps do not repair. With the defence AdamParams
    itself refuses them (the first assertion)."""
    from lockstep.engine.trainer import Trainer
    from lockstep.engine.types import AdamParams, Datum, EngineError, LoraSpec

    with pytest.raises(EngineError, match="must be a number in"):
        AdamParams(**values)
    trainer = Trainer.from_pretrained(builtin_dir, lora=LoraSpec(rank=4))
    data = [Datum.from_tokens([5, 6, 7, 8, 9])]
    assert np.isfinite(trainer.forward(data).loss_fn_outputs[0]["logprobs"]).all()
    trainer.forward_backward(data, "cross_entropy")
    trainer.optim_step(unchecked(AdamParams(), **values))
    for _ in range(2):  # good steps afterwards: the loss (or gradient) is NaN, so each is refused
        with pytest.raises(EngineError, match="loss is nan|not finite"):
            trainer.forward_backward(data, "cross_entropy")
            trainer.optim_step(AdamParams(learning_rate=1e-3))
    assert not np.isfinite(trainer.forward(data).loss_fn_outputs[0]["logprobs"]).any()


# -- end to end: the official SDK against the API and the worker -------------------------------------
def test_sdk_a_refused_step_leaves_the_model_and_training_goes_on(tmp_path, builtin_dir):
    """learning_rate=1e30 was accepted and left the model NaN for good (the old behaviour: this
    test then fails at the first pytest.raises). Refused, the model answers exactly as before,
    and the gradients it holds train on at a sane rate."""
    with in_process_service(tmp_path, {"lockstep/tiny": builtin_dir}) as (url, sessions):
        with sessions() as s:
            key = create_tenant(s, "ada")[1]
        tc = tinker.ServiceClient(base_url=url, api_key=key).create_lora_training_client(
            base_model="lockstep/tiny", rank=4, seed=0).result(timeout=120)
        tok = tc.get_tokenizer()
        data = [sft_datum(tok, f"{a}+{a}=", f"{2 * a:02d}") for a in range(4)]

        def logprobs():
            out = tc.forward(data, "cross_entropy").result(timeout=120)
            return [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]

        before = logprobs()
        tc.forward_backward(data, "cross_entropy").result(timeout=120)
        for params, match in ((types.AdamParams(learning_rate=1e30), r"learning_rate: .*\[0, 1\]"),
                              (types.AdamParams(eps=0.0), r"eps: .*\[1e-20, 1\]")):
            with pytest.raises(tinker.BadRequestError, match=match):
                tc.optim_step(params).result(timeout=60)
        rl = types.Datum(model_input=data[0].model_input, loss_fn_inputs={
            "target_tokens": data[0].loss_fn_inputs["target_tokens"],
            "advantages": np.ones(data[0].model_input.length, np.float32)})
        with pytest.raises(tinker.BadRequestError, match=r"needs loss_fn_inputs\['logprobs'\]"):
            tc.forward_backward([rl], "importance_sampling").result(timeout=60)
        after = logprobs()
        assert all(np.array_equal(a, b) for a, b in zip(before, after))  # bit for bit: nothing was applied
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=60)
        trained = logprobs()
        assert all(np.isfinite(t).all() for t in trained)
        assert sum(float(t.sum()) for t in trained) > sum(float(b.sum()) for b in before)  # the SFT step helped
