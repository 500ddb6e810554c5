"""Fuzzing the API in CI: every operation of the OpenAPI schema (/api/v1 and /v1) and hostile
protobuf forward_backward bodies, against the API and a real Executor in this process on SQLite.
No answer is a 5xx, none hangs, and afterwards the server still serves the SDK's normal session.
bench/service_fuzz.py runs the long version against a live `lockstep serve`."""

import pytest
import tinker
from tinker import types

from lockstep.service.tenants import create_tenant
from service_fuzzing import Fuzzer, in_process_service, make_objects

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")
SCHEMA_CASES, PROTOBUF_CASES = 1000, 400


@pytest.fixture(scope="module")
def fuzzer(tmp_path_factory, builtin_dir):
    home = tmp_path_factory.mktemp("fuzz")
    with in_process_service(home, {"lockstep/tiny": builtin_dir}) as (url, sessions):
        with sessions() as s:
            keys = {"a": create_tenant(s, "a")[1], "b": create_tenant(s, "b")[1]}
        yield Fuzzer(url, keys, make_objects(url, keys["a"]))


def test_no_schema_case_is_a_5xx_or_a_hang(fuzzer):
    tally = fuzzer.schema_cases(SCHEMA_CASES, fail_fast=True)
    assert tally.cases >= SCHEMA_CASES and not tally.failures, tally.summary()
    assert sum(n for code, n in tally.statuses.items() if code == 200) >= 50, tally.summary()  # it got past the 4xx


def test_no_protobuf_body_is_a_5xx_or_a_hang(fuzzer):
    tally = fuzzer.protobuf_cases(PROTOBUF_CASES, fail_fast=True)
    assert tally.cases >= SCHEMA_CASES + PROTOBUF_CASES and not tally.failures, tally.summary()


def test_the_server_still_serves_a_normal_session_afterwards(fuzzer):
    sc = tinker.ServiceClient(base_url=fuzzer.url, api_key=fuzzer.keys["a"])
    tc = sc.create_lora_training_client(base_model="lockstep/tiny", rank=4, seed=0).result(timeout=120)
    datum = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                        loss_fn_inputs={"target_tokens": types.TensorData(data=[6, 7, 8], dtype="int64", shape=[3])})
    losses = []
    for _ in range(3):
        fb = tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=120)
        losses.append(fb.result(timeout=120).metrics["loss:sum"])
    assert losses[-1] < losses[0], losses
