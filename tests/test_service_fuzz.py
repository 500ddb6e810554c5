"""Fuzzing the API in CI: every operation of the OpenAPI schema (/api/v1 and /v1) and hostile
protobuf forward_backward bodies, against the API and a real Executor in this process, on SQLite
(1,400 cases) and on PostgreSQL (700: it refuses what SQLite lets by, NUL in text for one). No
answer is a 5xx, none hangs, and afterwards the server still serves the SDK's normal session.
bench/service_fuzz.py runs the long version against a live `lockstep serve`."""

import pytest

from lockstep.service.tenants import create_tenant
from service_fuzzing import Fuzzer, Tally, in_process_service, make_objects, normal_session
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


@pytest.fixture(scope="module")
def schema_tally(fuzzer) -> Tally:
    """The schema cases, run once per store (each test that needs them, alone or in any order)."""
    fuzzer.tally = Tally()  # this phase's own count
    return fuzzer.schema_cases(fuzzer.cases[0], fail_fast=True)


@pytest.fixture(scope="module")
def protobuf_tally(fuzzer) -> Tally:
    fuzzer.tally = Tally()
    return fuzzer.protobuf_cases(fuzzer.cases[1], fail_fast=True)


def test_no_schema_case_is_a_5xx_or_a_hang(fuzzer, schema_tally):
    n = fuzzer.cases[0]
    assert schema_tally.cases >= n and not schema_tally.failures, schema_tally.summary()
    assert schema_tally.statuses[200] >= n // 20, schema_tally.summary()  # it got past the 4xx too


def test_no_protobuf_body_is_a_5xx_or_a_hang(fuzzer, protobuf_tally):
    assert protobuf_tally.cases >= fuzzer.cases[1] and not protobuf_tally.failures, protobuf_tally.summary()


def test_the_server_still_serves_a_normal_session_afterwards(fuzzer, schema_tally, protobuf_tally):
    assert schema_tally.cases and protobuf_tally.cases  # afterwards: both kinds of fuzzing were run first
    losses = normal_session(fuzzer.url, fuzzer.keys["a"], timeout=120)
    assert losses[-1] < losses[0], losses
