"""The program that runs inside a sandbox: it sets the rlimits, then runs code sent to it.

Run by the system interpreter as `python3 -s -B -c <this source> <config json>` (no file of ours is
mounted into the sandbox), so it must stay stdlib-only and self-contained. It starts before any
code is known (a pool keeps ready sandboxes), reads length-prefixed JSON requests from the control
pipe and answers each on the other:

  {"id", "code", "mode": "program" | "cell", "cpu_s"} -> {"id", "status", "error", "limit", "exit_code", "cpu_s"}

"program" runs the code as __main__ and exits with its status, as `python3 prog.py` would. "cell"
runs it in the one namespace kept across requests (the tool env's interpreter), showing the value
of a final expression as the REPL does; processes a cell started are killed when it ends. Each request gets `cpu_s` CPU seconds more than the
process has used so far (the soft RLIMIT_CPU; SIGXCPU when spent, SIGKILL at the hard limit).
Untrusted code runs in this same process, so nothing here is a security boundary: the sandbox
around it is. The verdict it reports is only used to label a failure (the supervisor trusts
exit statuses and its own timers).
"""

import ast
import errno
import json
import os
import resource
import struct
import sys
import traceback

_LIMIT_ERRNOS = {errno.EFBIG: "file_size", errno.EMFILE: "open_files", errno.ENFILE: "open_files",
                 errno.EAGAIN: "processes"}


def _read(fd):
    head = b""
    while len(head) < 4:
        chunk = os.read(fd, 4 - len(head))
        if not chunk:
            return None
        head += chunk
    (n,) = struct.unpack(">I", head)
    body = b""
    while len(body) < n:
        chunk = os.read(fd, n - len(body))
        if not chunk:
            return None
        body += chunk
    return json.loads(body)


def _write(fd, obj):
    data = json.dumps(obj).encode()
    data = struct.pack(">I", len(data)) + data
    while data:
        data = data[os.write(fd, data):]


def _cpu_used():
    r = resource.getrusage(resource.RUSAGE_SELF)
    c = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime + c.ru_utime + c.ru_stime


def _classify(exc):
    """(status, limit) of an exception that ended a program or cell."""
    if isinstance(exc, MemoryError):
        return "limit", "memory"
    if isinstance(exc, OSError) and exc.errno in _LIMIT_ERRNOS:
        return "limit", _LIMIT_ERRNOS[exc.errno]
    return "error", None


def _run(code, namespace, mode):
    """Run `code`; returns (status, error, limit, exit_code)."""
    try:
        tree = ast.parse(code, "<program>" if mode == "program" else "<cell>")
        last = None
        if mode == "cell" and tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, "<program>" if mode == "program" else "<cell>", "exec"), namespace)
        if last is not None:
            value = eval(compile(last, "<cell>", "eval"), namespace)
            if value is not None:
                print(repr(value))
        return "ok", "", None, 0
    except SystemExit as e:
        code = e.code
        if code is None or isinstance(code, int):
            code = code or 0
        else:
            print(code, file=sys.stderr)
            code = 1
        return ("ok" if code == 0 else "error"), ("" if code == 0 else f"SystemExit({code})"), None, code
    except BaseException as e:  # noqa: BLE001 - the program's failure is the verdict
        traceback.print_exc()
        status, limit = _classify(e)
        return status, f"{type(e).__name__}: {str(e)[:500]}", limit, 1


def main():
    cfg = json.loads(sys.argv[1])
    ctl_in, ctl_out = cfg["in"], cfg["out"]
    for name, (soft, hard) in cfg["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    cpu_hard = cfg["rlimits"]["RLIMIT_CPU"][1]
    import random

    random.seed(0)  # every interpreter draws the same numbers: a replayed one rebuilds the same state
    os.chdir(cfg["cwd"])
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    while True:
        req = _read(ctl_in)
        if req is None:
            os._exit(0)
        used = _cpu_used()
        resource.setrlimit(resource.RLIMIT_CPU, (min(cpu_hard, int(used + req["cpu_s"]) + 1), cpu_hard))
        if req["mode"] == "program":
            namespace = {"__name__": "__main__", "__builtins__": __builtins__, "__file__": req.get("name", "<program>")}
        status, error, limit, exit_code = _run(req["code"], namespace, req["mode"])
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - a program may close or replace its streams
            pass
        if req["mode"] == "cell" and cfg["reap"] and os.getpid() == 2:
            # Processes a call started do not outlive it: an idle interpreter between tool calls
            # is not watched, and a background child could grow there. Only in the sandbox's own
            # PID namespace (where this is pid 2 and -1 means "every process here but init").
            try:
                os.kill(-1, 9)
            except OSError:
                pass
            while True:  # reap this process's own children (zombies count against RLIMIT_NPROC)
                try:
                    os.waitpid(-1, 0)
                except ChildProcessError:
                    break
                except OSError:
                    break
        _write(ctl_out, {"id": req["id"], "status": status, "error": error, "limit": limit, "exit_code": exit_code,
                         "cpu_s": _cpu_used() - used})
        if req["mode"] == "program":
            os._exit(exit_code & 0xFF)


if __name__ == "__main__":  # run by `python3 -c`, never imported
    main()
