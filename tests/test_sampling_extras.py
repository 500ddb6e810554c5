"""Tinker's sampling extras (topk_prompt_logprobs, topk_sample_logprobs, target_prompt_logprobs,
prompt_alt_tokens_k, prompt_logprobs_last_n): each logprob is, bit for bit, what the trainer's
forward gives for that token at that position, alone, in a packed mixed-adapter batch and with
speculation on; ties in a top-k list come larger logprob first, then smaller token id; hostile
widths are refused before any compute. The last test drives them through the real SDK."""

import dataclasses
import math
import random

import numpy as np
import pytest
import torch

from lockstep.engine.adapters import AdapterTrainer, SharedBase
from lockstep.engine.drafters import make_drafter
from lockstep.engine.sampler import Sampler
from lockstep.engine.scores import top_k
from lockstep.engine.types import Datum, EngineError, LoraSpec, SampleRequest, SamplingParams

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head")


def bits(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32).view(np.uint32)


@pytest.fixture(scope="module")
def base(qwen2_dir):
    return SharedBase.from_pretrained(qwen2_dir)


@pytest.fixture(scope="module")
def tenants(base):
    """Two LoRA tenants of the shared base (one adapts lm_head), their B drawn so each moves logprobs."""
    out = []
    for i, (rank, targets) in enumerate([(4, ALL), (2, ("q_proj", "down_proj"))]):
        t = AdapterTrainer(base, LoraSpec(rank=rank, alpha=8.0, target_modules=targets, seed=i), name=f"x{i}")
        g = torch.Generator().manual_seed(50 + i)
        with torch.no_grad():
            for name, p in t.params.items():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
        out.append(t)
    return out


def forward_logprobs(model, tokens, targets_TK) -> np.ndarray:
    """The trainer's forward (cross_entropy `forward`) over model_input = tokens, one datum per
    column of targets_TK (T, K): column k's logprob of targets_TK[t, k] at position t, float32."""
    data = [Datum(tuple(tokens), {"target_tokens": np.asarray(col, np.int64), "weights": np.ones(len(col), np.float32)})
            for col in np.asarray(targets_TK).T]
    out = model.forward(data, "cross_entropy")
    return np.stack([o["logprobs"] for o in out.loss_fn_outputs], axis=1).astype(np.float32)


def extras_request(rng: random.Random, vocab: int, adapter=None, **kw) -> SampleRequest:
    prompt = tuple(rng.randrange(4, 200) for _ in range(rng.choice((5, 9, 17))))
    target = np.full((len(prompt) - 1, 3), -1, np.int64)
    for t in range(1, len(prompt) - 1, 2):  # every other row; row 0 unnamed: scoring starts at row 1
        named = rng.randint(1, 3)
        target[t, :named] = [rng.randrange(vocab) for _ in range(named)]
    params = SamplingParams(max_tokens=6, seed=rng.randrange(1 << 20), stop=(), temperature=rng.choice((1.0, 0.7)))
    fields = {"prompt_logprobs": True, "topk_prompt_logprobs": rng.choice((1, 4)),
              "topk_sample_logprobs": rng.choice((2, 5)), "target_prompt_ids": target, "prompt_alt_tokens_k": 3,
              "num_samples": 2, "adapter": adapter}
    return SampleRequest(prompt, params, **{**fields, **kw})


def check_against_trainer(trainer, request: SampleRequest, result) -> None:
    """Every extra of `result` equals the trainer's forward for that token at that position."""
    prompt = request.prompt
    L = len(prompt)
    top = result.topk_prompt_logprobs
    assert top.token_ids.shape == (L, request.topk_prompt_logprobs)
    assert (top.token_ids[0] == -1).all() and np.isnan(top.logprobs[0]).all()  # position 0: no context
    assert bits(forward_logprobs(trainer, prompt[:-1], top.token_ids[1:])).tolist() == bits(top.logprobs[1:]).tolist()
    assert bits(forward_logprobs(trainer, prompt[:-1], np.asarray(prompt[1:])[:, None]))[:, 0].tolist() == \
        bits(result.prompt_logprobs[1:]).tolist()
    ids = request.target_prompt_ids
    want = forward_logprobs(trainer, prompt[:-1], np.where(ids >= 0, ids, 0))
    assert bits(np.where(ids >= 0, want, 0.0)).tolist() == bits(result.target_prompt_logprobs).tolist()
    alt = result.prompt_alt_tokens
    assert alt.token_ids.shape == (L - 1, request.prompt_alt_tokens_k)
    assert bits(forward_logprobs(trainer, prompt[:-1], alt.token_ids)).tolist() == bits(alt.logprobs).tolist()
    for s in result.sequences:  # sampled token j is predicted at position L - 1 + j of prompt + tokens
        k = request.topk_sample_logprobs
        assert s.topk_logprobs.token_ids.shape == (len(s.tokens), k)
        targets = np.concatenate([np.zeros((L - 1, k), np.int64), s.topk_logprobs.token_ids])
        lp = forward_logprobs(trainer, (prompt + s.tokens)[:-1], targets)
        assert bits(lp[L - 1 :]).tolist() == bits(s.topk_logprobs.logprobs).tolist()


def reference_top(trainer_model, prompt, k) -> tuple[np.ndarray, np.ndarray]:
    """Top-k by a full stable sort of the model's log-softmax rows (larger first, then smaller id)."""
    with torch.no_grad():
        lp = trainer_model.log_softmax(trainer_model.logits(trainer_model.hidden_states(torch.tensor([prompt[:-1]]))))[0]
    order = torch.sort(lp, dim=-1, descending=True, stable=True).indices[:, :k]
    return order.numpy(), lp.gather(1, order).numpy()


def test_top_k_orders_ties_by_smaller_token_id_and_its_prefixes_are_the_smaller_top_ks():
    row = torch.tensor([[-1.0, 0.0, -2.0, 0.0, -1.0, -1.0, 0.0]])
    ids, lps = top_k(row, 5)
    assert ids.tolist() == [[1, 3, 6, 0, 4]] and lps.tolist() == [[0.0, 0.0, 0.0, -1.0, -1.0]]
    for k in range(1, 8):  # a top-k's first j entries are the top-j
        assert top_k(row, k)[0].tolist()[0] == [1, 3, 6, 0, 4, 5, 2][:k]
    nan = torch.tensor([[math.nan, -1.0, -3.0]])  # a NaN row still gives k ids, the NaN last
    assert top_k(nan, 3)[0].tolist() == [[1, 2, 0]]


def test_prompt_and_sample_extras_equal_the_trainers_forward_bitwise(base, tenants):
    """On the bare base and on a LoRA tenant (lm_head adapted): top-k prompt lists (and that they
    are the top-k of the full distribution), target ids' logprobs, alternatives and each sampled
    token's top-k equal the trainer's forward; the plain sample is unchanged by asking for them."""
    rng = random.Random(0)
    sampler = Sampler(base.model, base.tokenizer)
    for trainer in tenants[:1]:
        req = extras_request(rng, base.model.config.vocab_size, adapter=trainer.snapshot())
        [res] = sampler.sample([req])
        check_against_trainer(trainer, req, res)
        plain = dataclasses.replace(req, prompt_logprobs=False, topk_prompt_logprobs=0, topk_sample_logprobs=0,
                                    target_prompt_ids=None, prompt_alt_tokens_k=0)
        assert sampler.sample([plain])[0].sequences == tuple(dataclasses.replace(s, topk_logprobs=None)
                                                              for s in res.sequences)
    bare_req = extras_request(rng, base.model.config.vocab_size, topk_prompt_logprobs=6)
    [bare] = sampler.sample([bare_req])
    ids, lps = reference_top(base.model, bare_req.prompt, 6)
    assert (bare.topk_prompt_logprobs.token_ids[1:] == ids).all()
    assert bits(bare.topk_prompt_logprobs.logprobs[1:]).tolist() == bits(lps).tolist()


@pytest.mark.parametrize("drafter", ["off", "suffix"])
def test_a_packed_mixed_adapter_batch_gives_each_request_its_alone_extras(base, tenants, drafter):
    """Tenants' and bare-base requests with different extras (and widths) in one call, shuffled,
    speculation off or on: each request's extras and samples are those it gets alone, and still
    the trainer's forward (checked on one tenant's request)."""
    rng = random.Random(1)
    vocab = base.model.config.vocab_size
    owners = [t.snapshot() for t in tenants] + [None]
    reqs = [extras_request(rng, vocab, adapter=a) for a in owners for _ in range(2)]
    reqs.append(SampleRequest((7, 8, 9), SamplingParams(max_tokens=5, seed=3, stop=())))  # asks for nothing
    drafter_obj = make_drafter(drafter, target=base.model, tokenizer=base.tokenizer) if drafter != "off" else None
    sampler = Sampler(base.model, base.tokenizer, drafter=drafter_obj)
    alone = [sampler.sample([r])[0] for r in reqs]
    order = list(range(len(reqs)))
    rng.shuffle(order)
    packed = sampler.sample([reqs[i] for i in order])
    for i, res in zip(order, packed):
        a = alone[i]
        assert res.sequences == a.sequences, i  # tokens, logprobs and topk_logprobs, bitwise
        assert bits(res.prompt_logprobs or ()).tolist() == bits(a.prompt_logprobs or ()).tolist()
        assert res.topk_prompt_logprobs == a.topk_prompt_logprobs and res.prompt_alt_tokens == a.prompt_alt_tokens
        if a.target_prompt_logprobs is not None:
            assert bits(res.target_prompt_logprobs).tolist() == bits(a.target_prompt_logprobs).tolist()
    assert packed[order.index(len(reqs) - 1)].topk_prompt_logprobs is None
    if drafter != "off":
        assert sampler.spec_stats.accepted > 0  # drafted tokens were verified, their top-k from the verify forward
    check_against_trainer(tenants[0], reqs[0], packed[order.index(0)])


def test_last_n_scores_only_the_prompts_suffix(base):
    sampler = Sampler(base.model, base.tokenizer)
    prompt = tuple(range(30, 50))
    full = SampleRequest(prompt, SamplingParams(max_tokens=1, seed=0), prompt_logprobs=True, topk_prompt_logprobs=3)
    tail = dataclasses.replace(full, prompt_logprobs_last_n=4)
    [a], [b] = sampler.sample([full]), sampler.sample([tail])
    assert np.isnan(b.prompt_logprobs[:-4]).all() and bits(b.prompt_logprobs[-4:]).tolist() == \
        bits(a.prompt_logprobs[-4:]).tolist()
    assert (b.topk_prompt_logprobs.token_ids[:-4] == -1).all()
    assert (b.topk_prompt_logprobs.token_ids[-4:] == a.topk_prompt_logprobs.token_ids[-4:]).all()
    assert bits(b.topk_prompt_logprobs.logprobs[-4:]).tolist() == bits(a.topk_prompt_logprobs.logprobs[-4:]).tolist()


def test_alternatives_follow_the_seed_and_temperature(base):
    sampler = Sampler(base.model, base.tokenizer)
    prompt = tuple(range(60, 72))

    def alt(seed, temperature, k=8):
        r = SampleRequest(prompt, SamplingParams(max_tokens=1, seed=seed, temperature=temperature),
                          prompt_alt_tokens_k=k, topk_prompt_logprobs=1, prompt_logprobs=True)
        return sampler.sample([r])[0]

    a, b, c = alt(1, 1.0), alt(1, 1.0), alt(2, 1.0)
    assert a.prompt_alt_tokens == b.prompt_alt_tokens and a.prompt_alt_tokens != c.prompt_alt_tokens
    assert len(set(a.prompt_alt_tokens.token_ids.ravel().tolist())) > 11  # draws, not one token per row
    greedy = alt(1, 0.0)  # temperature 0: every draw is the argmax, the top-1
    assert (greedy.prompt_alt_tokens.token_ids == greedy.topk_prompt_logprobs.token_ids[1:, :1]).all()


@pytest.mark.parametrize("kw, match", [
    ({"topk_prompt_logprobs": -1}, "integer >= 0"),
    ({"prompt_logprobs_last_n": 2}, "set prompt_logprobs"),
    ({"prompt_logprobs": True, "prompt_logprobs_last_n": 4}, r"\[1, 3\]"),
    ({"target_prompt_ids": np.full((3, 2), -1, np.int64)}, "names no token id"),
    ({"target_prompt_ids": np.zeros((4, 2), np.int64)}, "3 rows"),
    ({"target_prompt_ids": np.zeros((3, 2), np.int32)}, "int64"),
])
def test_bad_extras_are_refused_when_the_request_is_built(kw, match):
    with pytest.raises(EngineError, match=match):
        SampleRequest((1, 2, 3, 4), SamplingParams(max_tokens=1), **kw)


@pytest.mark.parametrize("kw, match", [
    ({"topk_prompt_logprobs": 10**6}, "exceeds the vocabulary"),
    ({"topk_sample_logprobs": 10**6}, "exceeds the vocabulary"),
    ({"target_prompt_ids": np.array([[5], [10**6], [-1]], np.int64)}, "outside the vocabulary"),
])
def test_the_sampler_refuses_widths_and_ids_beyond_the_vocabulary_before_any_compute(base, kw, match):
    sampler = Sampler(base.model, base.tokenizer)
    with pytest.raises(EngineError, match=match):
        sampler.check([SampleRequest((1, 2, 3, 4), SamplingParams(max_tokens=1), **kw)])


# -- the wire: hostile extras are 400s before anything is allocated ------------------------------
def tensor(data, shape, **kw) -> dict:
    return {"data": data, "dtype": "int64", "shape": shape, **kw}


@pytest.mark.parametrize("extra, match", [
    ({"topk_prompt_logprobs": 261}, "topk_prompt_logprobs=261 exceeds the model's vocabulary of 260"),
    ({"topk_sample_logprobs": 200, "num_samples": 256, "sampling_params": {"max_tokens": 64}},
     "topk_sample_logprobs asks for 3,276,800 logprobs"),
    ({"prompt_alt_tokens_k": 10**6}, "prompt_alt_tokens_k asks for 3,000,000 logprobs"),
    ({"prompt_logprobs_last_n": 2}, "set prompt_logprobs"),
    ({"prompt_logprobs": True, "prompt_logprobs_last_n": 4}, "1 to len(prompt) - 1 = 3"),
    ({"target_prompt_logprobs": tensor([1] * 6, [3, 2], extra_key=1)}, "must be a TensorData"),
    ({"target_prompt_logprobs": {**tensor([1] * 6, [3, 2]), "dtype": "float32"}}, "int64 token ids"),
    ({"target_prompt_logprobs": tensor([1] * 6, [2, 3])}, "shape [len(prompt) - 1 = 3, K >= 1]"),
    ({"target_prompt_logprobs": tensor([1], [3, 2**40])}, "asks for 3,298,534,883,328 logprobs"),  # before allocating
    ({"target_prompt_logprobs": tensor([1] * 5, [3, 2])}, "5 values do not fill shape [3, 2]"),
    ({"target_prompt_logprobs": tensor([1, 2, 3, 260, 5, 6], [3, 2])}, "entry 3, 260, is not an integer in [-1, 260)"),
    ({"target_prompt_logprobs": tensor([1, 2, 3, 4.0, 5, 6], [3, 2])}, "entry 3, 4.0"),
    ({"target_prompt_logprobs": tensor([1, 2, 3, True, 5, 6], [3, 2])}, "entry 3, True"),
    ({"target_prompt_logprobs": tensor([-1] * 6, [3, 2])}, "names no token id"),
    ({"target_prompt_logprobs": tensor([5, 6], [3, 2], sparse_crow_indices=[0, 2, 2, 2])}, "go together"),
    ({"target_prompt_logprobs": tensor([5, 6], [3, 2], sparse_crow_indices=[0, 2, 1, 2], sparse_col_indices=[0, 1])},
     "rising row pointers"),
    ({"target_prompt_logprobs": tensor([5, 6], [3, 2], sparse_crow_indices=[0, 2, 2, 2], sparse_col_indices=[1, 1])},
     "listed twice"),
    ({"target_prompt_logprobs": tensor([5, 6], [3, 2], sparse_crow_indices=[0, 2, 2, 2], sparse_col_indices=[0, 2])},
     "sparse_col_indices: entry 1, 2, is not an integer in [0, 2)"),
])
def test_hostile_extras_are_refused_naming_the_field_and_bound(extra, match):
    from lockstep.service import sample_extras
    from lockstep.service.types import ServiceError

    body = {"num_samples": 1, "sampling_params": {"max_tokens": 4}, **extra}
    with pytest.raises(ServiceError) as e:
        sample_extras.check(body, 4, 260)
    assert match in str(e.value)


def test_a_sparse_target_keeps_its_layout_and_unlisted_cells_name_nothing():
    from lockstep.service import sample_extras

    t = sample_extras.check({"target_prompt_logprobs": tensor([5, 9, 7], [3, 2], sparse_crow_indices=[0, 2, 2, 3],
                                                               sparse_col_indices=[1, 0, 1])}, 4, 260)
    assert t.ids.tolist() == [[9, 5], [-1, -1], [-1, 7]]
    assert [x.tolist() for x in t.csr] == [[0, 2, 2, 3], [1, 0, 1]]


# -- through the real SDK ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sdk_server(tmp_path_factory):
    from test_service_sdk import make_server

    srv = make_server(tmp_path_factory.mktemp("extras"))
    srv.keys = {"alice": srv.key("alice")}
    try:  # a server that never came up is stopped too: its processes must not outlive the test
        srv.start()
        yield srv
    finally:
        srv.stop()


def test_the_sdk_gets_every_extra_equal_to_the_training_clients_forward(sdk_server):
    """SDK 0.38 `sample` with all five extras (a sparse target tensor, last_n), against a LoRA
    client's sampler after a training step: each value equals its `forward` logprob bit for bit;
    a width beyond the vocabulary is a 400 naming the bound."""
    import tinker
    from tinker import types

    sc = tinker.ServiceClient(base_url=sdk_server.url, api_key=sdk_server.keys["alice"])
    tc = sc.create_lora_training_client(base_model="lockstep/tiny", rank=4, seed=0).result()
    prompt = [(7 * i + 3) % 200 + 4 for i in range(12)]
    L = len(prompt)
    datum = types.Datum(model_input=types.ModelInput.from_ints(prompt[:-1]),
                        loss_fn_inputs={"target_tokens": np.array(prompt[1:], np.int64),
                                        "weights": np.ones(L - 1, np.float32)})
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()  # the adapter now moves logprobs
    sampler = tc.save_weights_and_get_sampling_client().result()
    ids = torch.full((L - 1, 3), -1, dtype=torch.int64)
    ids[4, :2], ids[9, :3] = torch.tensor([5, 17]), torch.tensor([250, 6, 40])
    out = sampler.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=5, seed=2, temperature=0.8),
                         include_prompt_logprobs=True, topk_prompt_logprobs=4, topk_sample_logprobs=3,
                         target_prompt_logprobs=types.TensorData.from_torch_sparse(ids, pad_value=-1),
                         prompt_alt_tokens_k=2, prompt_logprobs_last_n=L - 2).result()

    top = out.topk_prompt_logprobs[2:]
    top_ids = np.array([[t for t, _ in row] for row in top])
    alt_ids = out.prompt_alt_tokens.tokens.to_numpy()
    seq_top = [np.array([[t for t, _ in row] for row in seq.topk_logprobs]) for seq in out.sequences]
    columns = [(prompt[:-1], c) for c in np.concatenate([np.zeros((1, 4), np.int64), top_ids]).T]  # top-k
    columns += [(prompt[:-1], np.array(prompt[1:]))]  # the prompt's own tokens
    columns += [(prompt[:-1], c) for c in ids.clamp(min=0).numpy().T]  # target ids
    columns += [(prompt[:-1], c) for c in alt_ids.T]  # alternatives
    for seq, rows in zip(out.sequences, seq_top):  # each sampled token's top-k
        columns += [((prompt + seq.tokens)[:-1], c) for c in np.concatenate([np.zeros((L - 1, 3), np.int64), rows]).T]
    data = [types.Datum(model_input=types.ModelInput.from_ints(list(tokens)),
                        loss_fn_inputs={"target_tokens": np.asarray(col, np.int64),
                                        "weights": np.ones(len(col), np.float32)}) for tokens, col in columns]
    fwd = [o["logprobs"].to_numpy() for o in tc.forward(data, "cross_entropy").result().loss_fn_outputs]  # one call

    assert out.prompt_logprobs[:2] == [None, None] and out.topk_prompt_logprobs[:2] == [None, None]  # last_n
    assert top_ids.shape == (L - 2, 4)
    assert bits(np.stack(fwd[:4], 1)[1:]).tolist() == bits([[lp for _, lp in row] for row in top]).tolist()
    assert bits(fwd[4][1:]).tolist() == bits(out.prompt_logprobs[2:]).tolist()
    assert out.target_prompt_logprobs.sparse_crow_indices is not None  # the request's sparse layout
    got = out.target_prompt_logprobs.to_numpy()  # unlisted cells: 0.0
    assert bits(np.where(ids.numpy() >= 0, np.stack(fwd[5:8], 1), 0.0)).tolist() == bits(got).tolist()
    assert alt_ids.shape == (L - 1, 2)
    assert bits(np.stack(fwd[8:10], 1)).tolist() == bits(out.prompt_alt_tokens.logprobs.to_numpy()).tolist()
    for j, seq in enumerate(out.sequences):
        lp = np.stack(fwd[10 + 3 * j : 13 + 3 * j], 1)[L - 1 :]
        assert bits(lp).tolist() == bits([[x for _, x in row] for row in seq.topk_logprobs]).tolist()
    with pytest.raises(tinker.BadRequestError, match="vocabulary"):
        sampler.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=1),
                       include_prompt_logprobs=True, topk_prompt_logprobs=10**5).result()
