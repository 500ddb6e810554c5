"""Which tinker SDK versions the Tinker API serves, checked once at `create_session`.

Every SDK from 0.16 sends its own version in `CreateSessionRequest.sdk_version`. The JSON era
(0.16-0.24) sends JSON `forward_backward` bodies and a separate `/forward` that this server does
not speak, so it is refused here, before a session or a model exists, with the upgrade to run (the
hosted service refuses old SDKs at this call too). Versions newer than the newest one the matrix
ran (bench/sdk_matrix.py, docs/sdk_versions.md) are served with a warning, which the SDK logs.
"""

from __future__ import annotations

from packaging.version import InvalidVersion, Version

from lockstep.service.types import ServiceError

MIN_SDK = Version("0.25.0")
"""The first SDK with protobuf `forward_backward` bodies and forward through `forward_only`."""
TESTED_NEWEST = Version("0.38.0")
"""The newest SDK in the tested matrix (docs/sdk_versions.md); raise it with a matrix run."""
UPGRADE = "pip install -U 'tinker>=0.25'"


class UnsupportedSdk(ServiceError):
    """An SDK older than MIN_SDK: 400, naming the supported versions and the upgrade."""


def check_sdk_version(sdk_version: str) -> str | None:
    """Refuse an SDK older than MIN_SDK; return the warning for one newer than TESTED_NEWEST.

    An empty or unparsable version (a hand-written client, not the SDK) is served without a
    warning: nothing says which wire format it speaks, and the routes refuse what they cannot read.
    """
    try:
        version = Version(sdk_version)
    except InvalidVersion:
        return None
    if version < MIN_SDK:
        raise UnsupportedSdk(
            f"tinker SDK {version} is not supported: this server speaks the protobuf wire protocol of "
            f"tinker {MIN_SDK.major}.{MIN_SDK.minor} and later (tested up to {TESTED_NEWEST}); "
            f"upgrade with: {UPGRADE}")
    if version.release[:2] > TESTED_NEWEST.release[:2]:
        return (f"tinker SDK {version} is newer than the newest version this lockstep server was tested "
                f"with ({TESTED_NEWEST}); it may send requests the server does not understand")
    return None
