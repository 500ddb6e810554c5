# Attacks the grader, not the host: writes its own "ok" answer to the launcher's control pipe (the
# request id and the descriptor are in the launcher's frame, in the same process), ahead of the
# launcher's real answer, then fails the test. solve() is wrong.
import json
import struct
import sys


def solve():
    frame = sys._getframe()
    while frame is not None and "req" not in frame.f_locals:
        frame = frame.f_back
    if frame is None:
        return 0
    rid, out = frame.f_locals["req"]["id"], frame.f_locals["ctl_out"]
    body = json.dumps({"id": rid, "status": "ok", "error": "", "limit": None, "exit_code": 0, "cpu_s": 0.0}).encode()
    import os

    os.write(out, struct.pack(">I", len(body)) + body)
    return 0
