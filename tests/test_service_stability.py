"""record_stability_info, sequence ids and provenance spans (service/stability.py), the
stable_reinforce refusal, and inflight sampling clients.

The API tests run the API in-process with no worker (test_service_api.serving): a recorded
sample's records get their tokens through `stability.record_update`, the very update the worker
commits with the sample's result. The SDK tests drive tinker 0.38 against `lockstep serve`.
"""

import datetime as dt

import numpy as np
import pytest
from sqlalchemy import select

from lockstep.service import stability, wire
from lockstep.service.db import StabilityRecord, now
from lockstep.service.policy import Limits, Policy
from test_service_api import counts, fwdbwd, new_model, post, serving

PROMPT = [5, 6, 7, 8]
SAMPLED = [9, 10, 11]
PROTO = {"Content-Type": "application/x-protobuf"}


@pytest.fixture()
def api(tmp_path, builtin_dir):
    with serving(tmp_path, builtin_dir) as served:
        yield served


def sampler(client, key, sid, seq=0):
    r = post(client, "create_sampling_session", key, {"session_id": sid, "sampling_session_seq_id": seq,
                                                      "base_model": "lockstep/tiny"})
    assert r.status_code == 200, r.text
    return r.json()["sampling_session_id"]


def sample(client, key, ssid, *, record=True, num_samples=1, prompt=PROMPT, max_tokens=len(SAMPLED)):
    return post(client, "asample", key, {"sampling_session_id": ssid, "num_samples": num_samples,
                                         "prompt": {"chunks": [{"type": "encoded_text", "tokens": list(prompt)}]},
                                         "sampling_params": {"max_tokens": max_tokens},
                                         "record_stability_info": record})


def finish(sessions, ids, sampled=SAMPLED, weights="ephemeral/k"):
    """Commit a sample's result to its records, as the worker does."""
    result = wire.encode_sample_response([(sampled, [-0.5] * len(sampled), "length")] * len(ids), None)
    update = stability.record_update({"record_stability_info": True, "sample_sequence_ids": ids}, result, weights)
    with sessions() as s:
        update(s)
        s.commit()


def recorded(client, sessions, key, sid):
    """A finished recorded sample of PROMPT -> SAMPLED in session `sid`: its sequence id."""
    r = sample(client, key, sampler(client, key, sid))
    assert r.status_code == 200, r.text
    [seq] = r.json()["sample_sequence_ids"]
    finish(sessions, [seq])
    return seq


def span(seq, length, offset=0, *, sampled):
    return ("sampled_tokens" if sampled else "prompt_tokens", seq, offset, length)


def cookbook_spans(seq_in, seq_tgt=None):
    """rl_loop's `_with_stability_info` spans for prompt + sampled: the input drops the last
    token, the targets the first."""
    seq_tgt = seq_tgt or seq_in
    n, m = len(PROMPT), len(SAMPLED)
    return ([span(seq_in, n, sampled=False), span(seq_in, m - 1, sampled=True)],
            [span(seq_tgt, n - 1, 1, sampled=False), span(seq_tgt, m, sampled=True)])


def with_spans(body: bytes, spans_D) -> bytes:
    msg = wire.pb2().ForwardBackwardRequest.FromString(body)
    for d, pair in zip(msg.data, spans_D):
        for field, spans in zip(("model_input_spans", "loss_fn_input_spans"), pair):
            for arm, seq, offset, length in spans:
                x = getattr(getattr(d, field).add(), arm)
                x.sequence_id, x.offset, x.length = seq, offset, length
    return msg.SerializeToString()


def train(client, key, mid, spans, *, tokens=None, seq_id=1, loss="cross_entropy"):
    full = PROMPT + SAMPLED
    tokens = tokens or full
    body = fwdbwd(mid, seq_id, tokens=tokens[:-1], targets=np.asarray(tokens[1:], np.int64), loss=loss)
    return client.post("/api/v1/forward_backward", content=with_spans(body, [spans]),
                       headers={"X-API-Key": key, **PROTO})


def test_sequence_ids_are_bound_to_their_session():
    ids = stability.sequence_ids("s1", 3, recorded=True) + stability.sequence_ids("s1", 2, recorded=False)
    assert len(set(ids)) == 5 and all(stability.issued_for("s1", i) for i in ids)
    assert not any(stability.issued_for("s2", i) for i in ids)
    flipped = "u" + ids[0][1:]  # a recorded id passed off as unrecorded (to skip its token check)
    assert not stability.issued_for("s1", flipped) and not stability.issued_for("s1", "r" + "0" * 32)


def test_recorded_provenance_trains_and_restarts_the_day(api):
    client, sessions, key, _ = api
    sid, mid = new_model(client, key)
    seq = recorded(client, sessions, key, sid)
    with sessions() as s:
        row = s.get(StabilityRecord, seq)
        assert list(np.frombuffer(row.prompt, np.int32)) == PROMPT and list(np.frombuffer(row.tokens, np.int32)) == SAMPLED
        assert row.weights == "ephemeral/k" and row.session_id == sid
        row.expires_at = now() + dt.timedelta(hours=1)  # most of its day gone
        s.commit()
    r = train(client, key, mid, cookbook_spans(seq))
    assert r.status_code == 200, r.text
    with sessions() as s:
        assert s.get(StabilityRecord, seq).expires_at > now() + dt.timedelta(hours=23)


BAD = {
    # case: (how the spans or tokens differ from the cookbook's, message fragment)
    "sampled_token": ("tokens", "datum 0: model_input_spans position 5 is token 3, but sequence {seq}'s sampled tokens "
                                "has token 10 at offset 1"),
    "prompt_token": ("prompt", "datum 0: model_input_spans position 1 is token 3, but sequence {seq}'s prompt has "
                               "token 6 at offset 1"),
    "tiling": ("tiling", "datum 0: loss_fn_input_spans cover 5 positions but the field has 6"),
    "one_list": ("one_list", "datum 0: provenance comes as a pair"),
    "past_the_end": ("past_end", "names positions [1, 4) of sequence {seq}'s sampled tokens, which has 3 tokens"),
    "other_session": ("other_session", "names sequence_id '{other}', which was not sampled in this model's session"),
    "other_tenant": ("other_tenant", "names sequence_id '{other}', which was not sampled in this model's session"),
    "expired": ("expired", "sequence_id {seq} has expired"),
    "unfinished": ("unfinished", "sequence_id {seq} has no sampled tokens"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_provenance_is_a_400_naming_datum_and_position(api, case):
    client, sessions, key, key_b = api
    sid, mid = new_model(client, key)
    seq = recorded(client, sessions, key, sid)
    how, message = BAD[case]
    spans, tokens, other = cookbook_spans(seq), None, ""
    if how == "tokens":
        tokens = PROMPT + [SAMPLED[0], 3, SAMPLED[2]]
    elif how == "prompt":
        tokens = [PROMPT[0], 3] + PROMPT[2:] + SAMPLED
    elif how == "tiling":
        spans = (spans[0], [span(seq, len(PROMPT) - 1, 1, sampled=False), span(seq, len(SAMPLED) - 1, sampled=True)])
    elif how == "one_list":
        spans = (spans[0], [])
    elif how == "past_end":
        spans = (spans[0], [span(seq, len(PROMPT) - 1, 1, sampled=False), span(seq, len(SAMPLED), 1, sampled=True)])
    elif how in ("other_session", "other_tenant"):
        other_key = key if how == "other_session" else key_b
        other_sid = post(client, "create_session", other_key, {"tags": [], "sdk_version": "0.38.0"}).json()["session_id"]
        other = recorded(client, sessions, other_key, other_sid)
        spans = cookbook_spans(seq, other)
    elif how in ("expired", "unfinished"):
        with sessions() as s:
            row = s.get(StabilityRecord, seq)
            if how == "expired":
                row.expires_at = now() - dt.timedelta(seconds=1)
            else:
                row.tokens = None
            s.commit()
    before = counts(sessions)
    r = train(client, key, mid, spans, tokens=tokens)
    assert r.status_code == 400, r.text
    assert message.format(seq=seq, other=other) in r.json()["error"], r.json()["error"]
    assert counts(sessions) == (before[0] + 1, before[1])  # refused: its seq_id settled, nothing queued to run


def test_a_swept_record_is_expired_not_unrecorded(api):
    """Once the janitor deleted an expired record its id still says it was recorded: a 400
    'expired', never a pass without the token check."""
    client, sessions, key, _ = api
    sid, mid = new_model(client, key)
    seq = recorded(client, sessions, key, sid)
    with sessions() as s:
        s.delete(s.get(StabilityRecord, seq))
        s.commit()
    r = train(client, key, mid, cookbook_spans(seq))
    assert r.status_code == 400 and f"sequence_id {seq} has expired" in r.json()["error"]


def test_the_janitor_deletes_records_whose_day_is_over(api, tmp_path):
    from lockstep.service import janitor
    from lockstep.service.storage import Storage

    client, sessions, key, _ = api
    sid, _ = new_model(client, key)
    ids = sample(client, key, sampler(client, key, sid), num_samples=2).json()["sample_sequence_ids"]
    with sessions() as s:
        s.get(StabilityRecord, ids[0]).expires_at = now() - dt.timedelta(seconds=1)
        s.commit()
    janitor.sweep(sessions, Storage(str(tmp_path / "storage")), session_ttl_s=3600)
    with sessions() as s:
        assert [r.id for r in s.scalars(select(StabilityRecord))] == [ids[1]]


def test_unrecorded_sequences_are_checked_for_their_session_only(api):
    """A sample without record_stability_info keeps no tokens: its id still names its session
    (the cookbook's rl.train attaches provenance whatever the loss)."""
    client, sessions, key, _ = api
    sid, mid = new_model(client, key)
    r = sample(client, key, sampler(client, key, sid), record=False)
    [seq] = r.json()["sample_sequence_ids"]
    assert seq.startswith("u")
    with sessions() as s:
        assert s.scalar(select(StabilityRecord)) is None  # nothing kept
    assert train(client, key, mid, cookbook_spans(seq)).status_code == 200
    forged = "u" + "0" * 16 + seq[17:]
    r = train(client, key, mid, cookbook_spans(forged), seq_id=2)
    assert r.status_code == 400 and "was not sampled in this model's session" in r.json()["error"]


def test_recorded_tokens_are_capped_per_tenant(tmp_path, builtin_dir):
    policy = Policy(limits=Limits(stability_quota_tokens=20))
    with serving(tmp_path, builtin_dir, policy=policy) as (client, sessions, key, key_b):
        sid, _ = new_model(client, key)
        ssid = sampler(client, key, sid)
        assert sample(client, key, ssid, num_samples=2).status_code == 200  # 2 x (4 + 3) = 14 tokens held
        r = sample(client, key, ssid, num_samples=1)
        assert r.status_code == 429, r.text
        assert "holds 14 recorded tokens and this request adds 1 x 7" in r.json()["error"]
        assert "stability_quota_tokens is 20" in r.json()["error"]
        assert sample(client, key, ssid, record=False).status_code == 200  # unrecorded sampling is not capped
        sid_b, _ = new_model(client, key_b)
        assert sample(client, key_b, sampler(client, key_b, sid_b), num_samples=2).status_code == 200  # per tenant
        with sessions() as s:  # expired records no longer count
            for row in s.scalars(select(StabilityRecord).where(StabilityRecord.session_id == sid)):
                row.expires_at = now() - dt.timedelta(seconds=1)
            s.commit()
        assert sample(client, key, ssid, num_samples=2).status_code == 200


def test_stable_reinforce_refusal_names_each_cookbook_override(api):
    client, _, key, _ = api
    _, mid = new_model(client, key)
    r = client.post("/api/v1/forward_backward", content=fwdbwd(mid, loss="stable_reinforce"),
                    headers={"X-API-Key": key, **PROTO})
    assert r.status_code == 400
    error = r.json()["error"]
    assert "has not published its objective" in error
    for where, flag in stability.STABLE_REINFORCE_OVERRIDES:
        assert f"{where}: {flag}" in error
    assert "recipes.rl_loop: loss_fn=importance_sampling" in error
    assert 'AsyncConfig(..., loss_fn="importance_sampling")' in error


# -- the SDK and the cookbook against `lockstep serve` ---------------------------------------------
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from test_service_sdk import make_server

    srv = make_server(tmp_path_factory.mktemp("stability"))
    srv.keys = {"alice": srv.key("alice")}
    srv.start()
    yield srv
    srv.stop()


def sdk(served):
    import tinker

    return tinker.ServiceClient(base_url=served.url, api_key=served.keys["alice"])


def draw(sampler, tok) -> list:
    """A seeded sample's tokens and logprobs: equal lists mean bit-for-bit equal samples."""
    from tinker import types

    res = sampler.sample(prompt=types.ModelInput.from_ints(tok.encode("12+34=")), num_samples=4,
                         sampling_params=types.SamplingParams(max_tokens=8, temperature=1.0, seed=7)).result()
    return [(list(s.tokens), list(s.logprobs)) for s in res.sequences]


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
def test_inflight_clients_sample_the_latest_inflight_save_bitwise(served):
    """Every inflight client of a model samples its latest inflight save, bit for bit what a
    snapshot of the same weights samples; a snapshot client keeps its weights."""
    from tinker import types
    from test_service_sdk import sft_datum

    tc = sdk(served).create_lora_training_client(base_model="lockstep/tiny", rank=4, seed=0).result()
    tok = tc.get_tokenizer()
    first = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    snap0 = tc.save_weights_and_get_sampling_client().result()
    before = draw(snap0, tok)
    assert draw(first, tok) == before
    for _ in range(2):
        tc.forward_backward([sft_datum(tok, "12+34=", "046")], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    second = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    after = draw(tc.save_weights_and_get_sampling_client().result(), tok)
    assert after != before  # the step moved the weights: the checks below can tell
    assert draw(second, tok) == after and draw(first, tok) == after  # the old client follows the target
    assert draw(snap0, tok) == before


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::FutureWarning")
def test_recorded_sdk_samples_train_with_the_cookbooks_provenance(served):
    """record_stability_info through the SDK, datums built by the cookbook's own
    trajectory_to_data (two turns in one datum), trained with importance_sampling; a datum whose
    sampled token was changed is refused naming the datum and position."""
    import dataclasses

    import tinker
    from tinker import types
    from tinker_cookbook.completers import TokensWithLogprobs
    from tinker_cookbook.rl.data_processing import trajectory_to_data
    from tinker_cookbook.rl.types import Trajectory, Transition

    tc = sdk(served).create_lora_training_client(base_model="lockstep/tiny", rank=4, seed=0).result()
    tok = tc.get_tokenizer()
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=3)
    ob1 = tok.encode("12+34=")
    s1 = sampler.sample(prompt=types.ModelInput.from_ints(ob1), num_samples=1, sampling_params=params).result().sequences[0]
    ob2 = ob1 + list(s1.tokens) + tok.encode(" again:")
    s2 = sampler.sample(prompt=types.ModelInput.from_ints(ob2), num_samples=1, sampling_params=params).result().sequences[0]
    assert s1.sequence_id.startswith("r") and s2.sequence_id.startswith("r")
    acts = [TokensWithLogprobs(list(s.tokens), list(s.logprobs), sequence_id=s.sequence_id) for s in (s1, s2)]
    traj = Trajectory(transitions=[Transition(ob=types.ModelInput.from_ints(ob), ac=ac, reward=1.0, episode_done=False)
                                   for ob, ac in zip((ob1, ob2), acts)], final_ob=types.ModelInput.empty())
    [datum] = trajectory_to_data(traj, 1.0)
    assert datum.loss_fn_input_spans is not None and len(datum.model_input_spans) == 4  # two turns, one datum
    datum = dataclasses.replace(datum, loss_fn_inputs={k: v for k, v in datum.loss_fn_inputs.items() if k != "mask"})
    out = tc.forward_backward([datum], "importance_sampling").result()
    assert out.metrics["importance_ratio:max"] == 1.0  # the recorded logprobs are the trainer's, exactly
    tokens = datum.model_input.to_ints()
    at = len(ob1) + 1  # the second sampled token of turn one
    tokens[at] = (tokens[at] + 1) % tok.vocab_size if hasattr(tok, "vocab_size") else 0
    bad = dataclasses.replace(datum, model_input=types.ModelInput.from_ints(tokens))
    with pytest.raises(tinker.BadRequestError, match=f"datum 0: model_input_spans position {at} is token"):
        tc.forward_backward([bad], "importance_sampling").result()


def run_cookbook_async(served, builtin_dir, tmp_path, loss_fn: str):
    import subprocess
    import sys
    from pathlib import Path

    log = tmp_path / f"cookbook-{loss_fn}"
    script = Path(__file__).resolve().parent / "cookbook_async_rl.py"
    r = subprocess.run([sys.executable, str(script), "--base-url", served.url, "--tokenizer", builtin_dir,
                        "--log-path", str(log), "--loss-fn", loss_fn],
                       env={**served.env, "TINKER_API_KEY": served.keys["alice"]}, capture_output=True, text=True,
                       timeout=600)
    return r, log


@pytest.mark.slow  # two cookbook runs, ~2-6 min on 2 shared cores; test_service_cookbook.py (sync, provenance unrecorded) and
# the SDK test above (the cookbook's provenance on recorded samples) keep this path in the default suite
def test_cookbook_async_rl_runs_with_only_the_loss_override(served, builtin_dir, tmp_path):
    """The cookbook's async rl.train defaults to stable_reinforce: it records its samples and
    attaches provenance, and the server refuses the loss naming the override; with that one
    override (AsyncConfig.loss_fn) the same run trains its 2 steps, provenance checked."""
    try:
        import tinker_cookbook  # noqa: F401
    except ImportError:
        from test_service_backends import unavailable

        unavailable("tinker-cookbook is not installed (scripts/setup.sh installs it with --no-deps)")
    import json

    from lockstep.service.db import connect

    r, _ = run_cookbook_async(served, builtin_dir, tmp_path, "default")
    assert r.returncode != 0, r.stderr[-3000:]
    assert "not supported by this server" in r.stderr and "with async_config: AsyncConfig(..., loss_fn=" in r.stderr
    _, sessions = connect(served.db)
    with sessions() as s:
        kept = list(s.scalars(select(StabilityRecord).where(StabilityRecord.tokens.is_not(None))))
    assert kept  # the default run sampled with record_stability_info
    r, log = run_cookbook_async(served, builtin_dir, tmp_path, "importance_sampling")
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()]
    assert sum("env/all/reward/total" in m for m in metrics) == 2
