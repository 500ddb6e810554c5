"""The tinker SDK version matrix's slow tier: bench/sdk_session.py run by four SDK versions spread
over 0.25-0.38, each from its own venv, against a real `lockstep serve`; and the real 0.24.1 SDK
refused at create_session with the upgrade to run (docs/sdk_versions.md has the whole matrix)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from packaging.version import Version
from sdk_matrix import (
    DEFAULT_CACHE,
    IndexUnreachable,
    Row,
    index_versions,
    latest_patches,
    markdown,
    run_matrix,
    venv_ready,
)

SPREAD = ["0.25.0", "0.30.4", "0.33.1", "0.38.0"]
REFUSED = "0.24.1"


def test_the_matrix_takes_the_latest_final_patch_of_each_minor_in_range():
    """From the index's listing as pip prints it (0.37 was never released; a pre-release is not a patch)."""
    listed = "0.39.0rc1, 0.38.0, 0.36.0, 0.33.1, 0.33.0, 0.30.4, 0.30.3, 0.26.2, 0.26.0, 0.25.0, 0.24.1, 0.16.1"
    got = latest_patches([Version(v) for v in listed.split(", ")], Version("0.25"), Version("0.38"))
    assert [str(v) for v in got] == ["0.25.0", "0.26.2", "0.30.4", "0.33.1", "0.36.0", "0.38.0"]
    table = markdown([Row("0.25.0", True, "", 12.34, [], []), Row("0.24.1", False, "connect: a | b", 1.0, [], [])])
    assert table.splitlines()[2:] == ["| 0.25.0 | yes | — | 12.3 |", "| 0.24.1 | no | connect: a \\| b | 1.0 |"]


@pytest.mark.slow  # four SDK sessions (~1-2 min each on 2 loaded cores), plus each venv's install once
def test_a_spread_of_sdk_versions_runs_the_whole_session_and_the_json_era_is_refused():
    versions = [REFUSED, *SPREAD]
    missing = [v for v in versions if not venv_ready(DEFAULT_CACHE, v)]
    if missing:
        try:
            index_versions([sys.executable, "-m", "pip"])
        except IndexUnreachable as e:
            pytest.skip(f"the package index cannot be reached to install tinker {', '.join(missing)}: {e}")
    rows = {r.version: r for r in run_matrix(versions, cache=DEFAULT_CACHE, timeout_s=1800)}
    for v in SPREAD:
        r = rows[v]
        assert r.passed, f"tinker {v}: {r.failed}"
        assert [s["step"] for s in r.steps] == ["connect", "lora_sft", "full_sft", "forward", "sample",
                                                 "compute_logprobs", "save_load_state", "rl_steps", "rest_listing"]
        assert not any("newer than" in w for w in r.warnings), r.warnings  # tested versions: no warning
    old = rows[REFUSED]
    assert not old.passed and [s["step"] for s in old.steps] == ["connect"]  # refused before any model
    assert "400" in old.failed and f"tinker SDK {REFUSED} is not supported" in old.failed, old.failed
    assert "pip install -U 'tinker>=0.25'" in old.failed, old.failed
