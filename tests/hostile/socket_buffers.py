# Attacks memory through Unix socket buffers: data queued in socketpairs (SO_SNDBUF raised to the
# host's wmem_max) is kernel memory, in no process's resident set, so the tree's memory watch never
# sees it, and one process's 64 descriptors can queue ~450 MiB. solve() returns 1 if 4 processes
# held more than the sandbox's whole memory bound (@SANDBOX_MEMORY_MB@ MiB) at once (each stops at
# half of it, so as not to hurt the host).
import os
import socket

BOUND = int("@SANDBOX_MEMORY_MB@") << 20
CHUNK = b"x" * 65536


def fill(stop):
    """Bytes queued in this process's socketpairs, up to `stop` or until the kernel says no."""
    held, pairs = 0, []
    while held < stop:
        try:
            a, b = socket.socketpair()
        except OSError:
            break
        pairs.append((a, b))
        for s in (a, b):
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 20)
                s.setblocking(False)
                while held < stop:
                    held += s.send(CHUNK)
            except OSError:  # full (EAGAIN), or the kernel refused the memory
                pass
    return held, pairs


def solve():
    report_r, report_w = os.pipe()
    release_r, release_w = os.pipe()
    kids = []
    for _ in range(4):
        try:
            pid = os.fork()
        except OSError:
            break
        if pid == 0:
            os.close(release_w)
            held, pairs = fill(BOUND // 2)
            os.write(report_w, b"%d\n" % held)
            os.close(report_w)
            os.read(release_r, 1)  # hold the queues until the parent has every report
            os._exit(0)
        kids.append(pid)
    os.close(report_w)
    data = b""
    while data.count(b"\n") < len(kids):
        chunk = os.read(report_r, 4096)
        if not chunk:  # every child reported or died
            break
        data += chunk
    os.close(release_w)
    for pid in kids:
        os.waitpid(pid, 0)
    return 1 if sum(int(x) for x in data.split()) > BOUND else 0
