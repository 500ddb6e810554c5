# Attacks host files next to the service: overwrites a canary file in the host's (world-writable)
# directory and creates a marker there. solve() returns 1 if it saw the host's canary and changed
# it or created the marker (the directory would also exist inside the sandbox's own /tmp, where
# writing proves nothing, so the canary's content is what shows the host's directory).
import os

HOST = "@HOST_TMP@"
TOKEN = "@TOKEN@"


def solve():
    canary = f"{HOST}/canary.txt"
    try:
        with open(canary) as f:
            visible = f.read().strip() == TOKEN
    except OSError:
        visible = False
    wrote = False
    try:
        with open(canary, "r+") as f:
            f.write("pwned")
        wrote = True
    except OSError:
        pass
    try:
        with open(f"{HOST}/@MARKER@-write", "x") as f:
            f.write("marker")
        wrote = True
    except OSError:
        pass
    for victim in (f"{HOST}/service.db", canary):
        try:
            os.rename(victim, victim + ".moved")
            wrote = True
        except OSError:
            pass
    return 1 if visible and wrote else 0
