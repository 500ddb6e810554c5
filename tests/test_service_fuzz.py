"""Fuzzing the API in CI: every operation of the OpenAPI schema (/api/v1 and /v1) and hostile
protobuf forward_backward bodies, against the API and a real Executor in this process, on SQLite
(1,400 cases) and on PostgreSQL (700: it refuses what SQLite lets by, NUL in text for one). No
answer is a 5xx, none hangs, and afterwards the server still serves the SDK's normal session.
bench/service_fuzz.py runs the long version against a live `lockstep serve`."""

import pytest
import tinker
from tinker import types

from lockstep.service.tenants import create_tenant
from service_fuzzing import Fuzzer, in_process_service, make_objects
from test_service_backends import postgres_url  # noqa: F401 - a fixture

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")
CASES = {"sqlite": (1000, 400), "postgres": (500, 200)}
"""(schema cases, protobuf cases) per store."""


@pytest.fixture(scope="module", params=sorted(CASES))
def fuzzer(request, tmp_path_factory, builtin_dir):
    home = tmp_path_factory.mktemp(f"fuzz-{request.param}")
    url = request.getfixturevalue("postgres_url") if request.param == "postgres" else None
    with in_process_service(home, {"lockstep/tiny": builtin_dir}, db_url=url) as (url, sessions):
        with sessions() as s:
            keys = {"a": create_tenant(s, f"a-{home.name}")[1], "b": create_tenant(s, f"b-{home.name}")[1]}
        fuzzer = Fuzzer(url, keys, make_objects(url, keys["a"]))
        fuzzer.cases = CASES[request.param]
        yield fuzzer


def test_no_schema_case_is_a_5xx_or_a_hang(fuzzer):
    n = fuzzer.cases[0]
    tally = fuzzer.schema_cases(n, fail_fast=True)
    assert tally.cases >= n and not tally.failures, tally.summary()
    assert tally.statuses[200] >= n // 20, tally.summary()  # it got past the 4xx too


def test_no_protobuf_body_is_a_5xx_or_a_hang(fuzzer):
    tally = fuzzer.protobuf_cases(fuzzer.cases[1], fail_fast=True)
    assert tally.cases >= sum(fuzzer.cases) and not tally.failures, tally.summary()


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
