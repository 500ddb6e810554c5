"""The model drafter (engine/draft_model.py): a small draft that learns online from the sampler's
own outputs and is swapped in between decode steps. Whatever it drafts, and whenever its weights
change, what is sampled and every logprob are plain decoding's."""

import json
import shutil
import time

import pytest
import torch

from lockstep.config.types import ConfigError, SpeculativeSpec
from lockstep.engine.draft_model import Published, trainable_state
from lockstep.engine.drafters import make_drafter
from lockstep.engine.loading import load_model
from lockstep.engine.model import InvariantLM
from lockstep.engine.sampler import Sampler
from lockstep.engine.tiny import save_model_dir, tiny_config
from lockstep.engine.types import EngineError
from test_sampler import WeightSwap, trainer_logprobs
from test_speculative import _requests, model_tok  # noqa: F401 - model_tok is a fixture


def _drafter(model, tok, **options):
    return make_drafter("model", target=model, tokenizer=tok, **options)


CASES = {
    "greedy": dict(max_tokens=24, temperature=0.0, stop=()),
    "temperature 1": dict(max_tokens=24, stop=()),
    "top-p and temperature, a stop string": dict(max_tokens=24, top_p=0.8, temperature=0.7, stop=("\n",)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_outputs_and_logprobs_equal_plain_decoding(case, model_tok):
    """Over calls between which the draft learns and is swapped in: every token and logprob equals
    plain decoding's, and each logprob the trainer's recomputation."""
    model, tok = model_tok
    drafter = _drafter(model, tok, batch=8, updates=2)
    plain, fast = Sampler(model, tok), Sampler(model, tok, drafter=drafter, draft_tokens=4)
    try:
        for _ in range(3):
            reqs = _requests(tok, **CASES[case])
            got = fast.sample(reqs)
            assert [r.sequences for r in got] == [r.sequences for r in plain.sample(reqs)]
            drafter.trainer.wait_idle()
        for r, q in zip(got, reqs) if "temperature" not in case.split(",")[0] or case == "temperature 1" else ():
            for s in r.sequences:  # (logprobs are reported at the row's temperature: recomputed at 1 here)
                assert trainer_logprobs(model, q.prompt, s.tokens)[len(q.prompt) - 1 :].tolist() == list(s.logprobs)
        assert drafter.version >= 2 and drafter.trainer.errors == 0  # it learned and was swapped in
        st = fast.spec_stats
        assert st.accepted > 0 and (case == "greedy" or st.drafted > st.accepted)  # sampling rejects some
    finally:
        drafter.close()


@pytest.mark.parametrize("arch", ["llama_dir", "moe_dir"])
def test_other_architectures_get_an_early_exit_draft(arch, request):
    """Llama, and a Qwen3 mixture of experts (layer 0 dense, layer 1 routed): the draft is the
    target's own first layers, and outputs stay plain decoding's."""
    hf, tok = load_model(request.getfixturevalue(arch))
    model = InvariantLM(hf)
    drafter = _drafter(model, tok, layers=2, train=False)
    assert type(drafter.model.causal) is type(hf) and drafter.model.config.num_hidden_layers == 2
    reqs = _requests(tok, n_prompts=3, samples=2, max_tokens=12, temperature=0.0, stop=())
    fast = Sampler(model, tok, drafter=drafter, draft_tokens=3)
    assert [r.sequences for r in fast.sample(reqs)] == [r.sequences for r in Sampler(model, tok).sample(reqs)]
    assert fast.spec_stats.accepted > 0 and fast.spec_stats.drafter_errors == 0


def _greedy_draft(draft: InvariantLM, seq: list[int], k: int) -> list[int]:
    """k greedy tokens of the draft after seq, by full forwards without a cache."""
    seq, out = list(seq), []
    with torch.no_grad():
        for _ in range(k):
            nxt = int(draft.logits(draft.hidden_states(torch.tensor([seq]))[0, -1]).argmax())
            out.append(nxt)
            seq.append(nxt)
    return out


def test_the_draft_cache_drafts_what_the_drafts_full_forward_would(model_tok):
    """The session feeds only what its cache lacks and keeps confirmed drafts' entries; its drafts
    equal a from-scratch greedy decode of the draft model after every pattern of acceptance."""
    model, tok = model_tok
    drafter = _drafter(model, tok, train=False)
    prompts = [tuple(tok.encode(t)) for t in ("12+34=", "7*8=", "100-1=")]
    s = drafter.session(prompts, capacity=64)
    rows, k = [0, 1, 2], 4
    for step in range(6):
        drafts = s.draft(rows, [k, k, 2], k)
        for r in rows:
            want = _greedy_draft(drafter.model, s.seqs[r], k)
            assert drafts[r] == want[: 2 if r == 2 else k]
        # row 0 accepts everything, row 1 the first draft only, row 2 nothing; each then emits a new token
        s.append(0, drafts[0])
        s.append(1, drafts[1][:1])
        for r in rows:
            s.append(r, [tok.encode(str(step))[0]])
    assert s.fed[0] > len(prompts[0])  # confirmed drafts were kept, not fed again


def test_a_draft_swap_mid_generation_changes_nothing(model_tok):
    """New draft weights published in the middle of a call (and the policy's own weights swapped
    too) are taken at the next decode step; every token and logprob are those of plain decoding
    under the same policy swap."""
    model, tok = model_tok
    hf = model.hf_model
    reqs = _requests(tok, n_prompts=4, samples=3, max_tokens=30, stop=())
    plain = Sampler(model, tok)
    swap = WeightSwap(hf, plain, at=4)
    want = [r.sequences for r in plain.sample(reqs, between_steps=swap)]
    swap.use(swap.old)

    drafter = _drafter(model, tok, batch=10**3)  # it would never train by itself in this call
    fast = Sampler(model, tok, drafter=drafter, draft_tokens=3)
    swap = WeightSwap(hf, fast, at=4)
    noisy = {n: v + 0.5 * torch.randn_like(v) for n, v in trainable_state(drafter.trainer.draft).items()}
    seen = []

    def between_steps():
        seen.append(drafter.version)
        if len(seen) == 2:
            drafter.trainer.published = Published(7, noisy, data_version=0)
        return swap()

    try:
        got = [r.sequences for r in fast.sample(reqs, between_steps=between_steps)]
    finally:
        swap.use(swap.old)
        drafter.close()
    assert got == want
    assert seen[:3] == [0, 0, 7] and drafter.version == 7  # swapped at the next step, not at the next call
    assert fast.spec_stats.verify_steps > 0


def test_the_draft_learns_what_the_policy_writes(qwen2_dir):
    """Online distillation raises acceptance: trained between calls on the greedy completions of
    recurring prompts (RL re-samples its prompts), the draft comes to draft them. The target's
    weights are scaled up so that its greedy completions are varied, not one repeated token."""
    hf, tok = load_model(qwen2_dir)
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(3.0)
    model = InvariantLM(hf)
    drafter = _drafter(model, tok, batch=12, updates=8, lr=3e-3)
    fast = Sampler(model, tok, drafter=drafter, draft_tokens=4)
    reqs = _requests(tok, n_prompts=12, samples=1, max_tokens=32, temperature=0.0, stop=())
    rates = []
    try:
        for _ in range(4):
            before = (fast.spec_stats.drafted, fast.spec_stats.accepted)
            fast.sample(reqs)
            rates.append((fast.spec_stats.accepted - before[1]) / (fast.spec_stats.drafted - before[0]))
            drafter.trainer.wait_idle()
    finally:
        drafter.close()
    assert drafter.version == 3 and drafter.trainer.published.version == 4 and drafter.data_version == 0
    assert rates[0] < 0.4 and rates[-1] > 0.8, rates


def test_a_failing_draft_trainer_is_counted_and_drafting_goes_on(model_tok, monkeypatch):
    model, tok = model_tok
    drafter = _drafter(model, tok, batch=4)

    def broken(samples):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(drafter.trainer, "_step", broken)
    plain, fast = Sampler(model, tok), Sampler(model, tok, drafter=drafter, draft_tokens=3)
    try:
        for _ in range(2):
            reqs = _requests(tok, n_prompts=3, max_tokens=12, temperature=0.0, stop=())
            assert [r.sequences for r in fast.sample(reqs)] == [r.sequences for r in plain.sample(reqs)]
            drafter.trainer.wait_idle()
    finally:
        drafter.close()
    assert drafter.trainer.errors >= 2 and drafter.version == 0
    assert fast.spec_stats.drafter_errors == 0 and fast.spec_stats.drafted > 0


def test_the_trainer_thread_ends_when_idle_and_comes_back_with_data(model_tok):
    model, tok = model_tok
    drafter = _drafter(model, tok, batch=2)
    drafter.trainer.idle_s = 0.2
    try:
        sample = (list(range(5, 20)), 5)
        drafter.trainer.observe([sample, sample], policy_version=3)
        assert drafter.trainer.wait_idle() and drafter.trainer.published.data_version == 3
        deadline = time.time() + 10
        while drafter.trainer._thread is not None and time.time() < deadline:
            time.sleep(0.05)
        assert drafter.trainer._thread is None
        drafter.trainer.observe([sample, sample], policy_version=4)
        assert drafter.trainer.wait_idle() and drafter.trainer.published.version == 2
    finally:
        drafter.close()


def test_a_frozen_draft_keeps_its_last_weights_and_learns_no_more(model_tok):
    model, tok = model_tok
    drafter = _drafter(model, tok, batch=2)
    sample = (list(range(5, 20)), 5)
    drafter.trainer.observe([sample, sample], policy_version=1)
    drafter.freeze()  # waits for that step, takes its weights
    assert not drafter.learning and drafter.version == 1 and drafter.data_version == 1
    s = drafter.session([sample[0][:5]], capacity=32)
    s.append(0, sample[0][5:8])
    assert len(s.draft([0], [3], 3)[0]) == 3
    s.finish()  # not handed to the trainer any more
    assert drafter.trainer._new == [] and drafter.stats()["draft_train_steps"] == 2


def test_a_draft_with_another_vocabulary_or_tokenizer_is_refused(model_tok, tmp_path):
    model, tok = model_tok
    cfg = tiny_config(hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=128)
    cfg.vocab_size += 8
    bigger = save_model_dir(tmp_path / "bigger", cfg)
    with pytest.raises(EngineError, match="vocabulary of 268 tokens, the target 260"):
        _drafter(model, tok, path=str(bigger))
    cfg.vocab_size -= 8
    other = save_model_dir(tmp_path / "other", cfg)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = (k for k, v in vocab.items() if v in (10, 11))
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two tokens' ids exchanged: the same size, not the same text
    (other / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(EngineError, match="different tokenizer"):
        _drafter(model, tok, path=str(other))
    same = tmp_path / "same"
    shutil.copytree(other, same)
    shutil.copy(bigger.parent / "bigger" / "tokenizer.json", same / "tokenizer.json")
    drafter = _drafter(model, tok, path=str(same), train=False)  # a trained draft of the same tokenizer
    assert drafter.model.config.num_hidden_layers == 1


def test_bad_options_name_what_to_fix(model_tok):
    model, tok = model_tok
    with pytest.raises(EngineError, match="layers must be at most the target's 2, got 3"):
        _drafter(model, tok, layers=3)
    with pytest.raises(EngineError, match="batch must be an integer >= 1"):
        _drafter(model, tok, batch=0)
    with pytest.raises(EngineError, match="needs the target model"):
        make_drafter("model")
    for key, value in (("draft_layers", 0), ("draft_batch", 10**6), ("draft_lr", 2.0), ("draft_updates", "many")):
        with pytest.raises(ConfigError, match=f"rollout.speculative.{key}"):
            SpeculativeSpec(drafter="model", **{key: value})
