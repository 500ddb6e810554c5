"""A refused request never wedges a model: the official SDK against a live `lockstep serve`."""

import numpy as np
import pytest
import tinker
from sqlalchemy import func, select
from tinker import types

from lockstep.service.db import Request
from lockstep.service.tenants import create_tenant
from service_fuzzing import in_process_service
from test_service_sdk import make_server, sft_datum

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")


def test_the_same_client_keeps_training_after_each_kind_of_refused_request(tmp_path):
    """Each refusal consumes the SDK's seq_id; before the fix the model's next request waited for
    that seq_id forever (the SDK retrying try_again without end)."""
    srv = make_server(tmp_path)
    key = srv.key("rita")
    srv.start()
    try:
        tc = tinker.ServiceClient(base_url=srv.url, api_key=key).create_lora_training_client(
            base_model="lockstep/tiny", rank=4, seed=0).result(timeout=120)
        tok = tc.get_tokenizer()
        good = [sft_datum(tok, f"{a}+{a}=", f"{2 * a:02d}") for a in range(4)]
        adam = types.AdamParams(learning_rate=1e-2)

        def datum(tokens, targets):
            return types.Datum(model_input=types.ModelInput.from_ints(tokens),
                               loss_fn_inputs={"target_tokens": np.asarray(targets, np.int64)})

        refusals = {
            "outside the vocabulary": lambda: tc.forward_backward([datum([5, 10**6, 7], [6, 7, 8])], "cross_entropy"),
            "expected \\[3\\]": lambda: tc.forward_backward([datum([5, 6, 7], [6, 7])], "cross_entropy"),
            "does not take config keys": lambda: tc.forward_backward(good, "ppo", loss_fn_config={"bogus": 1.0}),
            "beta1": lambda: tc.optim_step(types.AdamParams(learning_rate=1e-2, beta1=2.0)),
            "no '/'": lambda: tc.save_state("../escape"),
        }
        losses = []
        for match, refused in refusals.items():
            with pytest.raises(tinker.BadRequestError, match=match):
                refused().result(timeout=60)
            fb = tc.forward_backward(good, "cross_entropy")
            tc.optim_step(adam).result(timeout=60)  # before the fix: queued behind the refused seq_id for good
            losses.append(fb.result(timeout=60).metrics["loss:sum"])
        assert losses[-1] < 0.9 * losses[0], losses  # it trained on
    finally:
        srv.stop()


def test_an_sdk_batch_over_the_token_cap_is_chunked_not_refused(tmp_path, builtin_dir):
    """client/config tells the SDK to chunk under max_tokens_per_request, so the cap bounds the
    Executor's memory without refusing any batch the SDK sends."""
    with in_process_service(tmp_path, {"lockstep/tiny": builtin_dir}, max_tokens_per_request=64) as (url, sessions):
        with sessions() as s:
            key = create_tenant(s, "cathy")[1]
        tc = tinker.ServiceClient(base_url=url, api_key=key).create_lora_training_client(
            base_model="lockstep/tiny", rank=4, seed=0).result(timeout=120)
        tok = tc.get_tokenizer()
        data = [sft_datum(tok, f"{a}{a}{a}+{a}{a}{a}=", f"{2 * a}" * 3) for a in range(1, 10)]
        assert sum(d.model_input.length for d in data) > 64  # one request would be refused
        out = tc.forward_backward(data, "cross_entropy").result(timeout=120)
        assert len(out.loss_fn_outputs) == len(data) and np.isfinite(out.metrics["loss:sum"])
        with sessions() as s:  # it went as several requests, each under the cap
            assert s.scalar(select(func.count()).select_from(Request).where(Request.kind == "forward_backward")) > 1
