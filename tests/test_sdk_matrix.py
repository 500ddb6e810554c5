"""The tinker SDK version matrix's slow tier: bench/sdk_session.py run by four SDK versions spread
over 0.25-0.38, each from its own venv, against a real `lockstep serve`; and the real 0.24.1 SDK
refused at create_session with the upgrade to run (docs/sdk_versions.md has the whole matrix)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "bench"))
from sdk_matrix import DEFAULT_CACHE, IndexUnreachable, index_versions, run_matrix, venv_ready  # noqa: E402

SPREAD = ["0.25.0", "0.30.4", "0.33.1", "0.38.0"]
REFUSED = "0.24.1"


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
