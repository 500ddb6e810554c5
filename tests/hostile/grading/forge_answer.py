# Attacks the grader, not the host: writes its own "ok" answer to the launcher's control pipe (the
# request id and the descriptor are in the launcher's frame, in the same process), ahead of the
# launcher's real answer, which it then drops (by wrapping the launcher's writer), and fails the
# test. Under the old judge a test that is a statement ran as a cell of this interpreter, so the
# forged answer was that test's verdict. solve() is wrong.
# tests: ["x = solve()\nassert x > 0", "for k in range(2):\n    assert solve() == 1 + k * 0"]
import json
import os
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
    os.write(out, struct.pack(">I", len(body)) + body)
    launcher = sys.modules["__main__"]
    write = getattr(launcher._write, "real", launcher._write)

    def drop_forged(fd, obj):  # the launcher's own (failing) answer to the forged request
        if obj.get("id") != rid:
            write(fd, obj)

    drop_forged.real = write
    launcher._write = drop_forged
    return 0
