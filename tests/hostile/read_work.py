# Attacks the workspace: the repository (its source, its .git) and /work, world-readable on the
# host. solve() returns 1 if it saw any of it.
import os

REPO = "@REPO@"


def solve():
    for path in (f"{REPO}/pyproject.toml", f"{REPO}/.git/HEAD", f"{REPO}/src/lockstep/sandbox/bwrap.py"):
        try:
            with open(path, "rb") as f:
                if f.read(1):
                    return 1
        except OSError:
            pass
    for d in ("/work", REPO):
        try:
            if os.listdir(d):
                return 1
        except OSError:
            pass
    return 0
