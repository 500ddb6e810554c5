# Attacks the workspace: creates marker files in /work and in the repository (world-readable, and
# writable by no one but root on the host). solve() returns 1 if it saw the repository and wrote
# into it (/work would be a directory of the sandbox's own root otherwise).
import os

REPO = "@REPO@"
MARKER = "@MARKER@"


def solve():
    visible = os.path.exists(f"{REPO}/pyproject.toml")
    wrote = False
    for path in (f"{REPO}/{MARKER}-work", f"/work/{MARKER}-work", f"{REPO}/src/{MARKER}-work"):
        try:
            with open(path, "x") as f:
                f.write("marker")
            wrote = True
        except OSError:
            pass
    return 1 if visible and wrote else 0
