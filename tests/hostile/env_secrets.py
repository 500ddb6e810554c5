# Attacks secrets in the environment: the test process holds a fake secret in its environment (an
# API key a trainer might have). Looks in its own environment, /proc/self/environ, and the
# environments of pid 1, its parent and the test process. solve() returns 1 if it found it.
import os

NAME = "@SECRET_NAME@"
TOKEN = "@TOKEN@"
HOST_PID = int("@HOST_PID@")


def solve():
    if NAME in os.environ or any(TOKEN in v for v in os.environ.values()):
        return 1
    for pid in ("self", "1", str(os.getppid()), str(HOST_PID)):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                data = f.read()
            if NAME.encode() in data or TOKEN.encode() in data:
                return 1
        except OSError:
            pass
    return 0
