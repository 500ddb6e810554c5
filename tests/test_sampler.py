"""Sampler behaviour a user relies on: parameters, stops, seeds, prefix sharing, consistency."""

import math

import pytest
import torch

from lockstep.engine.loading import load_model
from lockstep.engine.model import InvariantLM
from lockstep.engine.sampler import Sampler
from lockstep.engine.types import EngineError, SampleRequest, SamplingParams


@pytest.fixture(scope="module")
def sampler(qwen2_dir):
    hf, tok = load_model(qwen2_dir)
    return Sampler(InvariantLM(hf), tok)


def trainer_logprobs(model, prompt, tokens):
    """log p of every token after the first of prompt + tokens, by the trainer's full forward."""
    full = torch.tensor([list(prompt) + list(tokens)])
    with torch.no_grad():
        lp = model.logprobs_of(model.hidden_states(full[:, :-1]), full[:, 1:])[0]
    return lp


class WeightSwap:
    """A `between_steps` callback that, on its `at`-th call, swaps every parameter to perturbed
    weights (by `.data`, as the generator's zero-copy swap does) and sets the sampler's policy
    version to 1; `use(old or new)` puts either set back for a recomputation."""

    def __init__(self, hf, sampler, at: int = 3):
        self.params = dict(hf.named_parameters())
        self.old = {n: p.detach().clone() for n, p in self.params.items()}
        g = torch.Generator().manual_seed(0)
        self.new = {n: p + 0.05 * torch.randn(p.shape, generator=g) for n, p in self.old.items()}
        self.sampler, self.at, self.calls = sampler, at, 0

    def use(self, weights: dict) -> None:
        for n, p in self.params.items():
            p.data = weights[n]

    def __call__(self) -> bool:
        self.calls += 1
        if self.calls != self.at:
            return False
        self.use(self.new)
        self.sampler.policy_version = 1
        return True


def req(prompt, n=1, **kw):
    return SampleRequest(tuple(prompt), SamplingParams(**kw), num_samples=n)


def test_seeded_samples_are_reproducible_and_batch_independent(sampler):
    a = sampler.sample([req([5, 6, 7], n=3, max_tokens=12, seed=11, stop=())])[0]
    other = req([9] * 20, n=5, max_tokens=4, seed=1)
    b = sampler.sample([other, req([5, 6, 7], n=3, max_tokens=12, seed=11, stop=())])[1]
    assert a.sequences == b.sequences
    assert len({s.tokens for s in a.sequences}) > 1  # the n samples differ from each other
    c = sampler.sample([req([5, 6, 7], n=3, max_tokens=12, seed=12, stop=())])[0]
    assert c.sequences != a.sequences


def test_logprobs_equal_trainer_forward_bitwise(sampler):
    prompts = [[5 + i] * (1 + 3 * i) for i in range(7)]
    results = sampler.sample([req(p, n=2, max_tokens=10, seed=i, stop=()) for i, p in enumerate(prompts)])
    for p, r in zip(prompts, results):
        for s in r.sequences:
            lp = trainer_logprobs(sampler.model, p, s.tokens)[len(p) - 1 :]
            assert lp.tolist() == list(s.logprobs)


def test_prompt_logprobs_match_trainer(sampler):
    prompt = list(range(20, 45))
    r = sampler.sample([SampleRequest(tuple(prompt), SamplingParams(max_tokens=1, seed=0), prompt_logprobs=True)])[0]
    assert math.isnan(r.prompt_logprobs[0]) and len(r.prompt_logprobs) == len(prompt)
    lp = trainer_logprobs(sampler.model, prompt[:-1], prompt[-1:])
    assert list(r.prompt_logprobs[1:]) == lp.tolist()


def test_max_tokens_and_length_reason(sampler):
    s = sampler.sample([req([5], max_tokens=7, seed=0, stop=())])[0].sequences[0]
    assert len(s.tokens) == 7 and len(s.logprobs) == 7 and s.stop_reason == "length"
    assert s.policy_version == 0


def test_stop_token_is_included_and_ends_sample(sampler):
    free = sampler.sample([req([5, 6], max_tokens=30, seed=3, stop=())])[0].sequences[0]
    target = free.tokens[4]
    first = free.tokens.index(target)
    s = sampler.sample([req([5, 6], max_tokens=30, seed=3, stop=(target,))])[0].sequences[0]
    assert s.tokens == free.tokens[: first + 1] and s.stop_reason == "stop"


def test_stop_string_is_included_and_ends_sample(sampler):
    free = sampler.sample([req([5, 6], max_tokens=40, seed=4, stop=())])[0].sequences[0]
    text = sampler.tokenizer.decode(free.tokens[:6])
    stop = text[-2:]
    s = sampler.sample([req([5, 6], max_tokens=40, seed=4, stop=(stop,))])[0].sequences[0]
    assert s.stop_reason == "stop"
    assert sampler.tokenizer.decode(s.tokens).endswith(stop)
    assert s.tokens == free.tokens[: len(s.tokens)] and len(s.tokens) <= 6


def test_eos_stops_unless_stop_is_empty(sampler, monkeypatch):
    free = sampler.sample([req([5, 6], max_tokens=12, seed=0, stop=())])[0].sequences[0]
    eos = free.tokens[3]  # pretend this token is EOS, so that it is sampled for sure
    monkeypatch.setattr(sampler, "eos_id", eos)
    stopped = sampler.sample([req([5, 6], max_tokens=12, seed=0)])[0].sequences[0]
    assert stopped.tokens == free.tokens[: free.tokens.index(eos) + 1] and stopped.stop_reason == "stop"
    with_stops = sampler.sample([req([5, 6], max_tokens=12, seed=0, stop=("@@@",))])[0].sequences[0]
    assert with_stops.tokens == stopped.tokens  # EOS still ends generation beside explicit stops
    unstoppable = sampler.sample([req([5, 6], max_tokens=12, seed=0, stop=())])[0].sequences[0]
    assert unstoppable.tokens == free.tokens and unstoppable.stop_reason == "length"


def test_greedy_is_argmax_and_top_k_1_matches(sampler):
    g = sampler.sample([req([7, 8, 9], max_tokens=8, temperature=0.0, stop=())])[0].sequences[0]
    k1 = sampler.sample([req([7, 8, 9], max_tokens=8, top_k=1, seed=5, stop=())])[0].sequences[0]
    assert g.tokens == k1.tokens
    assert all(lp == 0.0 for lp in k1.logprobs)  # the truncated distribution is a point mass
    lp = trainer_logprobs(sampler.model, [7, 8, 9], g.tokens)[2:]
    assert lp.tolist() == list(g.logprobs)  # greedy reports the model's log p


def test_top_p_and_temperature_report_the_sampled_distribution(sampler):
    prompt = [10, 11, 12]
    s = sampler.sample([req(prompt, max_tokens=1, temperature=0.5, top_p=0.3, seed=9)])[0].sequences[0]
    with torch.no_grad():
        h = sampler.model.hidden_states(torch.tensor([prompt]))
        logits = sampler.model.logits(h)[0, -1] / 0.5
    probs = torch.softmax(logits, -1)
    order = probs.argsort(descending=True)
    kept, mass = [], 0.0
    for t in order.tolist():
        if mass >= 0.3:
            break
        kept.append(t)
        mass += float(probs[t])
    assert s.tokens[0] in kept
    expected = torch.log_softmax(logits[kept], -1)[kept.index(s.tokens[0])]
    assert abs(s.logprobs[0] - float(expected)) < 1e-5


def test_top_k_restricts_choices(sampler):
    prompt = [13, 14]
    with torch.no_grad():
        logits = sampler.model.logits(sampler.model.hidden_states(torch.tensor([prompt])))[0, -1]
    top3 = set(logits.topk(3).indices.tolist())
    r = sampler.sample([req(prompt, n=40, max_tokens=1, top_k=3, seed=1)])[0]
    chosen = {s.tokens[0] for s in r.sequences}
    assert chosen <= top3 and len(chosen) > 1


def test_prefix_is_prefilled_once_per_request(sampler, monkeypatch):
    calls = []
    real = sampler.model.hidden_states

    def spy(tokens, positions=None, cache=None):
        calls.append(tuple(tokens.shape))
        return real(tokens, positions, cache)

    monkeypatch.setattr(sampler.model, "hidden_states", spy)
    sampler.sample([req(list(range(4, 30)), n=8, max_tokens=3, seed=0, stop=())])
    assert calls[0] == (1, 26)  # one prefill row for 8 samples
    assert all(shape[1] == 1 for shape in calls[1:])  # then single-token decode steps


@pytest.mark.parametrize(
    "build, match",
    [
        (lambda: req([5, 999999], max_tokens=2), "outside the vocabulary"),
        (lambda: req([5], max_tokens=2, stop=(123456,)), "outside the vocabulary"),
        (lambda: req([5], max_tokens=0), "max_tokens"),
        (lambda: req([5], top_p=0.0), "top_p"),
        (lambda: req([5], top_k=0), "top_k"),
        (lambda: req([5], temperature=-1.0), "temperature"),
        (lambda: SampleRequest(()), "at least one token"),
    ],
)
def test_bad_requests_raise_clear_errors(sampler, build, match):
    with pytest.raises(EngineError, match=match):
        sampler.sample([build()])


def test_hot_swap_between_decode_steps_keeps_logprobs_exact(qwen2_dir):
    """Weights swapped mid-generation: later tokens carry the new version, and every token's
    logprob equals the trainer's recomputation under the version it records."""
    hf, tok = load_model(qwen2_dir)
    model = InvariantLM(hf)
    sampler = Sampler(model, tok)
    swap = WeightSwap(hf, sampler)

    prompts = [[5, 6, 7], [8] * 12]
    res = sampler.sample([req(p, n=2, max_tokens=8, seed=i, stop=()) for i, p in enumerate(prompts)], between_steps=swap)
    for p, r in zip(prompts, res):
        for s in r.sequences:
            assert s.policy_version == 0 and s.token_versions == (0, 0, 0, 1, 1, 1, 1, 1)
            swap.use(swap.old)
            before = trainer_logprobs(model, p, s.tokens)[len(p) - 1 :]
            swap.use(swap.new)
            after = trainer_logprobs(model, p, s.tokens)[len(p) - 1 :]
            assert before[:3].tolist() == list(s.logprobs[:3])  # tokens 0-2 sampled before the swap
            assert after[3:].tolist() == list(s.logprobs[3:])  # the rest under the new weights
            assert before[3:].tolist() != list(s.logprobs[3:])


@pytest.fixture(scope="module")
def peaky(qwen2_dir):
    """A model whose next-token distributions are sharp (final norm scaled by 30, so the top
    token often has p > 1 - 1e-5), as a trained model's are: then a top-p cumulative mass rounds
    to 1 before the last token, and where one row's rule leaks into another it shows."""
    hf, tok = load_model(qwen2_dir)
    with torch.no_grad():
        hf.model.norm.weight.mul_(30.0)
    return Sampler(InvariantLM(hf), tok)


MIXED = [  # (prompt, sampling params): each row its own treatment
    ((5, 6, 7), dict(seed=1)),  # plain: the model's own distribution
    ((5, 6, 8), dict(seed=2, temperature=0.7)),
    ((9, 10), dict(seed=3, top_k=3)),
    ((9, 11), dict(seed=4, top_p=0.9)),
    ((9, 12), dict(seed=5, top_p=0.8, temperature=1.3)),
    ((9, 13), dict(temperature=0.0)),  # greedy
    ((5, 6, 7), dict(seed=6, top_k=50, top_p=0.95)),
]


@pytest.mark.parametrize("which", ["sampler", "peaky"])
def test_mixed_sampling_params_per_row_never_depend_on_the_batch(which, request):
    s = request.getfixturevalue(which)
    reqs = [req(p, n=2, max_tokens=10, stop=(), **kw) for p, kw in MIXED]
    alone = [s.sample([r])[0].sequences for r in reqs]
    together = [r.sequences for r in s.sample(reqs)]
    reversed_ = [r.sequences for r in s.sample(reqs[::-1])][::-1]
    for k, (a, t, r) in enumerate(zip(alone, together, reversed_)):
        assert a == t == r, f"row {k} ({MIXED[k][1]}) depends on what shares its batch"
    for p, seqs in ((MIXED[0][0], together[0]), (MIXED[5][0], together[5])):  # plain and greedy rows
        for seq in seqs:  # report the model's own log p, exactly the trainer's, in a mixed batch too
            assert trainer_logprobs(s.model, p, seq.tokens)[len(p) - 1 :].tolist() == list(seq.logprobs)
