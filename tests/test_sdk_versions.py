"""Which tinker SDKs `create_session` serves: the JSON era (0.16-0.24) refused there with the upgrade
to run, 0.25-0.38 served, newer ones served with a warning the SDK logs.

The bodies are those the old SDKs send, built from their wheels' types: 0.16.1 dumps
CreateSessionRequest with `exclude_unset=True` (project_id=None kept, `type` left out), 0.18-0.24.1
with `exclude_unset=False, exclude_none=True` (`type` kept, project_id dropped).
"""

import pytest
from sqlalchemy import func, select
from test_service_api import post, serving

from lockstep.service.db import Session
from lockstep.service.sdk_versions import check_sdk_version


def body_of(version: str) -> dict:
    if version.startswith("0.16."):
        return {"tags": [], "user_metadata": {}, "sdk_version": version, "project_id": None}
    return {"tags": [], "user_metadata": {}, "sdk_version": version, "type": "create_session"}


@pytest.fixture(scope="module")
def api(tmp_path_factory, builtin_dir):
    with serving(tmp_path_factory.mktemp("sdk-versions"), builtin_dir) as served:
        yield served


def sessions_stored(sessions) -> int:
    with sessions() as s:
        return s.scalar(select(func.count()).select_from(Session))


@pytest.mark.parametrize("version", ["0.16.1", "0.18.2", "0.20.0", "0.22.7", "0.24.1", "0.25.0rc1"])
def test_json_era_sdks_are_refused_at_create_session_with_the_upgrade(api, version):
    client, sessions, key, _ = api
    before = sessions_stored(sessions)
    r = post(client, "create_session", key, body_of(version))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert f"tinker SDK {version} is not supported" in error
    assert "tinker 0.25 and later" in error and "pip install -U 'tinker>=0.25'" in error
    assert sessions_stored(sessions) == before  # refused before anything is stored


@pytest.mark.parametrize("version", ["0.25.0", "0.30.4", "0.38.0", "0.38.1"])
def test_tested_sdks_get_a_session_and_no_warning(api, version):
    client, sessions, key, _ = api
    before = sessions_stored(sessions)
    r = post(client, "create_session", key, body_of(version))
    assert r.status_code == 200, r.text
    assert r.json()["session_id"] and r.json()["warning_message"] is None
    assert sessions_stored(sessions) == before + 1


@pytest.mark.parametrize("version", ["0.39.0", "0.40.2", "1.0.0", "9" * 100])
def test_newer_sdks_are_served_with_a_warning_naming_the_tested_version(api, version):
    client, sessions, key, _ = api
    before = sessions_stored(sessions)
    r = post(client, "create_session", key, body_of(version))
    assert r.status_code == 200, r.text
    warning = r.json()["warning_message"]
    assert f"tinker SDK {version} is newer" in warning and "tested with (0.38.0)" in warning
    assert sessions_stored(sessions) == before + 1


@pytest.mark.parametrize("version", ["", "x", "0.24.1; drop table sessions", "\u0660.25"])
def test_a_version_that_is_not_one_is_served_without_a_warning(api, version):
    """Hand-written clients send anything here: nothing says which wire format they speak, and
    each route refuses what it cannot read."""
    client, _, key, _ = api
    r = post(client, "create_session", key, {"tags": [], "sdk_version": version})
    assert r.status_code == 200 and r.json()["warning_message"] is None, r.text
    assert check_sdk_version(version) is None

