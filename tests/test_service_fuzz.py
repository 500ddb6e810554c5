"""Fuzzing the API in CI: every operation of the OpenAPI schema (/api/v1 and /v1) and hostile
protobuf forward_backward bodies, against the API and a real Executor in this process, on SQLite
(1,400 cases) and on PostgreSQL (700: it refuses what SQLite lets by, NUL in text for one). No
answer is a 5xx, none hangs, and afterwards the server still serves the SDK's normal session.
bench/service_fuzz.py runs the long version against a live `lockstep serve`."""

import pytest

from lockstep.service.tenants import create_tenant
from service_fuzzing import Fuzzer, in_process_service, make_objects, normal_session
from test_service_backends import postgres_url  # noqa: F401 - a fixture

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")
CASES = {"sqlite": (1000, 400), "postgres": (500, 200)}
"""(schema cases, protobuf cases) per store."""


@pytest.fixture(scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.slow)])  # slow: time
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
    losses = normal_session(fuzzer.url, fuzzer.keys["a"], timeout=120)
    assert losses[-1] < losses[0], losses
