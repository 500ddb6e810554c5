"""Speculative decoding (engine/speculative.py, engine/drafters.py): drafts verified in one forward
never change what is sampled, nor a logprob; the cache after a rejection is as if the rejected
tokens had never been fed; a failing drafter only costs speed."""

import math
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

from lockstep.engine import speculative as spec
from lockstep.engine.drafters import SuffixDrafter
from lockstep.engine.loading import load_model
from lockstep.engine.model import InvariantLM
from lockstep.engine.sampler import Sampler
from lockstep.engine.types import EngineError, SampleRequest, SamplingParams
from test_sampler import WeightSwap, trainer_logprobs


@pytest.fixture(scope="module")
def model_tok(qwen2_dir):
    hf, tok = load_model(qwen2_dir)
    return InvariantLM(hf), tok


def _requests(tok, n_prompts=6, samples=4, **params):
    return [SampleRequest(tuple(tok.encode(f"{i * 37 % 1000}+{i * 91 % 1000}=")),
                          SamplingParams(seed=i, **params), num_samples=samples) for i in range(n_prompts)]


class _FixedDraft:
    """A point-mass drafter: always proposes the same token."""

    def __init__(self, token):
        self.token = token

    def session(self, prompts, **context):
        return self

    def append(self, row, tokens):
        pass

    def propose(self, row, k):
        return [self.token] * k

    def finish(self):
        pass


CASES = {
    "greedy": dict(max_tokens=24, temperature=0.0, stop=()),
    "temperature 1": dict(max_tokens=24, stop=()),
    "top-p and temperature, a stop string": dict(max_tokens=24, top_p=0.8, temperature=0.7, stop=("\n",)),
    "top-k": dict(max_tokens=20, top_k=5),
}


@pytest.mark.parametrize("case", list(CASES))
def test_outputs_and_logprobs_equal_plain_decoding(case, model_tok):
    """Every token and logprob equals plain decoding's (same seeds): with the suffix drafter, over
    two calls so that it also drafts from earlier completions of the same prompts, and with a
    drafter that is mostly wrong, so that rejections are exercised as much as acceptances."""
    model, tok = model_tok
    plain = Sampler(model, tok)
    suffix = Sampler(model, tok, drafter=SuffixDrafter(), draft_tokens=4)
    wrong = Sampler(model, tok, drafter=_FixedDraft(tok.encode("7")[0]), draft_tokens=3)
    for _ in range(2):
        reqs = _requests(tok, **CASES[case])
        want = [r.sequences for r in plain.sample(reqs)]
        assert [r.sequences for r in suffix.sample(reqs)] == want
        assert [r.sequences for r in wrong.sample(reqs)] == want
    assert suffix.spec_stats.accepted > 0 and wrong.spec_stats.drafted > wrong.spec_stats.accepted
    assert suffix.spec_stats.drafter_errors == wrong.spec_stats.drafter_errors == 0


def test_accepted_tokens_logprobs_equal_the_trainers_recomputation(model_tok):
    model, tok = model_tok
    fast = Sampler(model, tok, drafter=SuffixDrafter(), draft_tokens=6)
    reqs = _requests(tok, n_prompts=3, samples=3, max_tokens=30, stop=())
    fast.sample(reqs)
    for r, q in zip(fast.sample(reqs), reqs):
        for s in r.sequences:
            assert trainer_logprobs(model, q.prompt, s.tokens)[len(q.prompt) - 1 :].tolist() == list(s.logprobs)
    assert fast.spec_stats.mean_accepted > 0.5


def _target_probs(model, seq, top_p):
    with torch.no_grad():
        p = torch.softmax(model.logits(model.hidden_states(torch.tensor([seq])))[0, -1], -1).double()
    if top_p < 1:
        order = p.argsort(descending=True)
        mass_before = p[order].cumsum(0) - p[order]
        keep = torch.zeros_like(p, dtype=torch.bool)
        keep[order[mass_before < top_p]] = True
        p = torch.where(keep, p, torch.zeros_like(p))
    return p / p.sum()


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_a_verified_token_follows_the_targets_distribution(top_p, qwen2_dir):
    """Chi-square test of the second token, which a drafter proposing one fixed token always tries
    (kept with probability p(d), else the sample comes from the residual): over 20,000 seeds,
    grouped by the first token, the second token's counts match the target's probabilities (the
    trainer's forward, with the row's top-p applied); the statistics of the groups are summed."""
    hf, tok = load_model(qwen2_dir)
    with torch.no_grad():  # sharper distributions (a random model's are near uniform), as a trained model's
        hf.model.norm.weight.mul_(4.0)
    model = InvariantLM(hf)
    prompt = tuple(tok.encode("12+34="))
    d = tok.encode("5")[0]
    fast = Sampler(model, tok, drafter=_FixedDraft(d), draft_tokens=1)
    n = 20_000
    out = fast.sample([SampleRequest(prompt, SamplingParams(max_tokens=2, seed=s, stop=(), top_p=top_p))
                       for s in range(n)])
    pairs = torch.tensor([r.sequences[0].tokens for r in out])
    assert fast.spec_stats.accepted > 0 and fast.spec_stats.drafted > fast.spec_stats.accepted
    chi2, dof = 0.0, 0
    firsts, sizes = pairs[:, 0].unique(return_counts=True)
    for c in firsts[sizes >= 100].tolist():
        seconds = pairs[pairs[:, 0] == c, 1]
        p = _target_probs(model, list(prompt) + [c], top_p)
        counts = torch.bincount(seconds, minlength=p.numel()).double()
        assert counts[p == 0].sum() == 0  # nothing outside the row's top-p set
        expected = p * seconds.numel()
        big = expected >= 5
        observed = torch.cat([counts[big], counts[~big].sum().unsqueeze(0)])
        wanted = torch.cat([expected[big], expected[~big].sum().unsqueeze(0)])
        if wanted[-1] < 5:  # fold a thin tail into the smallest bin
            observed[-2] += observed[-1]
            wanted[-2] += wanted[-1]
            observed, wanted = observed[:-1], wanted[:-1]
        chi2 += float(((observed - wanted) ** 2 / wanted).sum())
        dof += observed.numel() - 1
    assert dof >= 20, (dof, sizes.max())
    # Wilson-Hilferty: the chi-square quantile at p = 1e-4 (z = 3.72)
    limit = dof * (1 - 2 / (9 * dof) + 3.72 * math.sqrt(2 / (9 * dof))) ** 3
    assert chi2 < limit, (chi2, limit, dof)


def test_rollback_leaves_the_cache_as_if_the_rejected_tokens_were_never_fed(model_tok):
    model, _ = model_tok
    prompt, fed = [5, 6, 7, 8], [9, 10, 11, 12]
    with torch.no_grad():
        spec_cache, plain_cache = model.new_cache(1, 16), model.new_cache(1, 16)
        for cache in (spec_cache, plain_cache):
            model.hidden_states(torch.tensor([prompt]), torch.arange(4).unsqueeze(0), cache)
        model.hidden_states(torch.tensor([fed]), torch.arange(4, 8).unsqueeze(0), spec_cache)  # 4 fed
        model.hidden_states(torch.tensor([fed[:2]]), torch.arange(4, 6).unsqueeze(0), plain_cache)  # 2 kept
    spec.rollback(spec_cache, torch.tensor([6]), torch.tensor([8]))
    for a, b in zip(spec_cache.k + spec_cache.v1, plain_cache.k + plain_cache.v1):
        assert torch.equal(a, b)


class _Broken(_FixedDraft):
    def __init__(self, where):
        super().__init__(7)
        self.where = where

    def session(self, prompts, **context):
        if self.where == "session":
            raise RuntimeError("drafter down")
        return self

    def propose(self, row, k):
        if self.where == "propose":
            raise RuntimeError("drafter down")
        return super().propose(row, k)


@pytest.mark.parametrize("where", ["session", "propose"])
def test_a_failing_drafter_degrades_to_plain_decoding(where, model_tok):
    model, tok = model_tok
    reqs = _requests(tok, n_prompts=2, samples=2, max_tokens=12, stop=())
    fast = Sampler(model, tok, drafter=_Broken(where))
    assert [r.sequences for r in fast.sample(reqs)] == [r.sequences for r in Sampler(model, tok).sample(reqs)]
    assert fast.spec_stats.drafter_errors == 1 and fast.spec_stats.plain_fallbacks == 1


class _OutOfVocabulary(_FixedDraft):
    """Proposes, in turn, ids past the vocabulary, negative ids, floats and bools, and a valid
    draft; counts the bad proposals it made."""

    def __init__(self, vocab_size):
        super().__init__(7)
        self.bad = [[vocab_size], [vocab_size + 1000, 7], [-1], [7.0], [True], [2**70]]
        self.calls = self.bad_made = 0

    def propose(self, row, k):
        self.calls += 1
        turn = self.calls % (len(self.bad) + 1)
        if turn == len(self.bad) or k == 0:
            return super().propose(row, k)
        self.bad_made += 1
        return self.bad[turn]


def test_draft_ids_outside_the_vocabulary_are_dropped_and_counted(model_tok):
    """A drafter's id must not reach the embedding unchecked: id >= vocab size would fail the whole
    call, a negative one index another token's row. Such a draft is dropped for that row and step
    (counted); the outputs stay plain decoding's and valid drafts still run."""
    model, tok = model_tok
    reqs = _requests(tok, n_prompts=2, samples=2, max_tokens=12, stop=())
    drafter = _OutOfVocabulary(model.config.vocab_size)
    fast = Sampler(model, tok, drafter=drafter, draft_tokens=2)
    assert [r.sequences for r in fast.sample(reqs)] == [r.sequences for r in Sampler(model, tok).sample(reqs)]
    st = fast.spec_stats
    assert drafter.bad_made > 0 and st.invalid_drafts == drafter.bad_made
    assert st.drafted > 0 and st.drafter_errors == 0 and st.plain_fallbacks == 0


class _Hangs(_FixedDraft):
    """Hangs on its `at`-th proposal until `release` is set (at most 120 s: a sampler that waits
    it out then fails the test instead of hanging it), then answers again."""

    def __init__(self, at):
        super().__init__(7)
        self.at, self.calls = at, 0
        self.release, self.hung, self.woke = threading.Event(), threading.Event(), threading.Event()

    def propose(self, row, k):
        self.calls += 1
        if self.calls == self.at:
            self.hung.set()
            self.release.wait(120)
            self.woke.set()
        return super().propose(row, k)


def test_a_hung_drafter_is_abandoned_and_restarted(model_tok):
    """A drafter call past `draft_timeout` is given up: the call decodes on plainly (the same
    outputs) and returns while the drafter is still blocked, the timeout is counted, and the next
    call drafts again with a fresh worker."""
    model, tok = model_tok
    reqs = _requests(tok, n_prompts=2, samples=2, max_tokens=12, stop=())
    want = [r.sequences for r in Sampler(model, tok).sample(reqs)]
    drafter = _Hangs(at=9)
    fast = Sampler(model, tok, drafter=drafter, draft_tokens=2, draft_timeout=0.5)
    try:
        assert [r.sequences for r in fast.sample(reqs)] == want
        # Not waited out: the call came back while the drafter is still inside its hang.
        assert drafter.hung.is_set() and not drafter.woke.is_set()
        st = fast.spec_stats
        assert st.drafter_timeouts == st.drafter_errors == 1 and st.plain_fallbacks == 1
        drafted = st.drafted
        assert [r.sequences for r in fast.sample(reqs)] == want
        assert st.drafted > drafted and st.drafter_timeouts == 1  # restarted: it drafts again
        assert not drafter.woke.is_set()  # the fresh worker drafted while the old one still hangs
    finally:
        drafter.release.set()
    with pytest.raises(EngineError, match="draft_timeout must be a positive number"):
        Sampler(model, tok, drafter=_FixedDraft(7), draft_timeout=0)


class _HangsForGood(_FixedDraft):
    """Every proposal blocks until the test releases it."""

    def __init__(self):
        super().__init__(7)
        self.release = threading.Event()

    def propose(self, row, k):
        self.release.wait()
        return super().propose(row, k)


def _drafter_threads() -> set:
    return {t for t in threading.enumerate() if t.name.startswith("drafter")}


def test_drafts_that_hang_for_good_leave_a_bounded_number_of_threads(model_tok):
    """Every sample() call's first draft hangs past the timeout: each call decodes plainly, and
    however many calls time out, at most MAX_ABANDONED abandoned drafter threads run (later calls
    are refused at once instead of starting another). Released, they end, and drafting resumes."""
    model, tok = model_tok
    reqs = _requests(tok, n_prompts=1, samples=2, max_tokens=6, stop=())
    want = [r.sequences for r in Sampler(model, tok).sample(reqs)]
    before = _drafter_threads()
    drafter = _HangsForGood()
    fast = Sampler(model, tok, drafter=drafter, draft_tokens=2, draft_timeout=0.05)
    calls = 2 * spec.MAX_ABANDONED + 2
    try:
        for _ in range(calls):
            assert [r.sequences for r in fast.sample(reqs)] == want
        st = fast.spec_stats
        assert st.drafter_timeouts == st.plain_fallbacks == calls
        stuck = _drafter_threads() - before
        assert len(stuck) <= spec.MAX_ABANDONED and all(t.daemon for t in stuck)
    finally:
        drafter.release.set()  # whatever failed, the hung calls end (and this process can exit)
    for t in stuck:
        t.join()
    assert [r.sequences for r in fast.sample(reqs)] == want and st.drafted > 0  # drafting again
    fast.close()
    assert _drafter_threads() - before == set()


def test_a_drafter_hung_for_good_does_not_keep_the_process_from_exiting():
    code = textwrap.dedent("""
        import threading
        from lockstep.engine.speculative import DraftGuard, DrafterTimeout
        guard = DraftGuard(0.05)
        try:
            guard.call(threading.Event().wait)  # never set: this call never returns
        except DrafterTimeout:
            print("timed out", flush=True)
    """)
    # The timeout only bounds a failure (the old non-daemon worker blocked exit for ever).
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout == "timed out\n", r.stderr


def test_hot_swap_with_speculation_keeps_every_logprob_exact(qwen2_dir):
    """Weights swapped between verify steps: every token records the version whose forward scored it,
    and its logprob equals the trainer's recomputation under that version."""
    hf, tok = load_model(qwen2_dir)
    model = InvariantLM(hf)
    sampler = Sampler(model, tok, drafter=SuffixDrafter(), draft_tokens=3)
    swap = WeightSwap(hf, sampler)

    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [8] * 12]
    res = sampler.sample([SampleRequest(tuple(p), SamplingParams(max_tokens=16, seed=i, stop=()), num_samples=2)
                          for i, p in enumerate(prompts)], between_steps=swap)
    assert sampler.spec_stats.accepted > 0
    for p, r in zip(prompts, res):
        for s in r.sequences:
            versions = list(s.token_versions)
            assert versions == sorted(versions) and versions[0] == 0 and versions[-1] == 1
            for version, weights in ((0, swap.old), (1, swap.new)):
                swap.use(weights)
                lp = trainer_logprobs(model, p, s.tokens)[len(p) - 1 :]
                mine = [i for i, v in enumerate(versions) if v == version]
                assert [lp[i].item() for i in mine] == [s.logprobs[i] for i in mine]


def test_bad_draft_settings_are_refused(model_tok):
    model, tok = model_tok
    for k in (0, -1, 2.5):
        with pytest.raises(EngineError, match="draft_tokens"):
            Sampler(model, tok, drafter=SuffixDrafter(), draft_tokens=k)
    with pytest.raises(ValueError, match="max_ngram"):
        SuffixDrafter(max_ngram=0)


def test_the_suffix_drafter_drafts_from_siblings_history_and_repetition():
    drafter = SuffixDrafter(max_ngram=3, window=2, max_prompts=2)
    s = drafter.session([(1, 2), (1, 2)])
    s.append(0, [5, 6, 7, 8, 9])  # row 0 ran ahead
    s.append(1, [5, 6])
    assert s.propose(1, 3) == [7, 8, 9]  # its sibling's continuation
    s.append(1, [3, 4, 3, 4])
    assert s.propose(1, 5) == [3, 4, 3, 4, 3]  # a repetition, extended past the end of its match
    assert s.propose(1, 0) == []
    s.finish()
    again = drafter.session([(1, 2)])
    assert again.propose(0, 4) == [5, 6, 3, 4]  # the most recent earlier completion of the same prompt
    for p in [(9,), (10,)]:  # two other prompts push (1, 2) out of the LRU
        drafter.session([p]).finish()
    assert drafter.session([(1, 2)]).propose(0, 2) == []
    many = SuffixDrafter(max_ngram=2, window=1)
    for completion in ([40, 41], [50, 51], [60, 61]):  # past 2 x window, the index is rebuilt
        s = many.session([(7,)])
        s.append(0, completion)
        s.finish()
    assert many.session([(7,)]).propose(0, 1) == [60]
    assert len(many._prompts[(7,)].completions) <= 2


def test_auto_width_follows_measured_cost_and_acceptance():
    auto = spec.AutoWidth(4, probe_every=5)
    assert auto.width(8, 8) == 4 and auto.width(8, 8) == 0  # two sizes measured first, alternating
    for n in (8, 40, 8, 40):  # a step costs 1 ms + 0.01 ms per fed token: mostly fixed cost
        auto.observe_forward(n, 1e-3 + 1e-5 * n)
    auto.observe_drafts(accepted=24, live_rows=8)  # 3 drafts a row accepted
    assert auto.width(8, 8) == 4  # pays at this size: 4 tokens a row for 1.4 ms against 1 for 1.08
    assert auto.width(64, 64) == 4  # 1 + 3 tokens for 4.2 ms against 1 for 1.64 ms: still pays
    for _ in range(60):  # now nothing is accepted any more
        auto.observe_drafts(accepted=0, live_rows=8)
    widths = [auto.width(8, 8) for _ in range(60)]
    probes = [i for i, w in enumerate(widths) if w]
    assert probes and len(probes) <= 4 and widths.count(0) >= 56  # off, probing at doubling gaps
    assert all(b - a > 5 for a, b in zip(probes, probes[1:]))
    for n in (64, 320) * 4:  # a step that costs in proportion to its tokens (compute-bound)
        auto.observe_forward(n, 1e-5 * n)
    for _ in range(60):
        auto.observe_drafts(accepted=16, live_rows=8)  # 2 a row: 3 tokens for 5x the cost
    assert auto.width(64, 64) == 0


def test_auto_turns_speculation_off_when_it_does_not_pay_and_changes_nothing(model_tok):
    model, tok = model_tok
    reqs = _requests(tok, n_prompts=4, samples=4, max_tokens=40, stop=())
    wrong = Sampler(model, tok, drafter=_FixedDraft(tok.encode("7")[0]), draft_tokens=4, auto=True)
    assert [r.sequences for r in wrong.sample(reqs)] == [r.sequences for r in Sampler(model, tok).sample(reqs)]
    assert wrong.spec_stats.auto_off_steps > wrong.spec_stats.verify_steps  # mostly plain once measured
    assert wrong.auto.gain < 0.2


class _Oracle:
    """Drafts exactly what a plain run produced for each row: every draft is accepted."""

    def __init__(self, completions):
        self.completions = completions

    def session(self, prompts, **context):
        self.seqs = [list(p) for p in prompts]
        self.plen = [len(p) for p in prompts]
        return self

    def append(self, row, tokens):
        self.seqs[row] += list(tokens)

    def propose(self, row, k):
        done = len(self.seqs[row]) - self.plen[row]
        return list(self.completions[row][done : done + k])

    def finish(self):
        pass


def test_a_stop_token_inside_an_accepted_run_ends_the_sample_there(model_tok):
    """Runs of confirmed drafts are recorded at once; a stop token inside one cuts it right after
    the stop, exactly where plain decoding stops."""
    model, tok = model_tok
    prompts = [tuple(tok.encode(f"{i}+{i}=")) for i in range(6)]
    free = Sampler(model, tok).sample([SampleRequest(p, SamplingParams(max_tokens=20, seed=i, stop=()))
                                       for i, p in enumerate(prompts)])
    completions = [r.sequences[0].tokens for r in free]
    reqs = [SampleRequest(p, SamplingParams(max_tokens=20, seed=i, stop=(completions[i][7],)))
            for i, p in enumerate(prompts)]
    oracle = Sampler(model, tok, drafter=_Oracle(completions), draft_tokens=5)
    got = [r.sequences for r in oracle.sample(reqs)]
    assert got == [r.sequences for r in Sampler(model, tok).sample(reqs)]
    assert all(s[0].stop_reason == "stop" and len(s[0].tokens) <= 8 for s in got)
    assert 0 < oracle.spec_stats.accepted < oracle.spec_stats.drafted  # every draft right, runs cut at the stop
