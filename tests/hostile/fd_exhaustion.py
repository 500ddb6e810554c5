# Attacks file descriptors: opens files, pipes and sockets until it cannot, keeping them all.
# solve() returns 1 only if it held more than the open-files limit.
import os
import socket

LIMIT = int("@OPEN_FILES@")


def solve():
    held = []
    try:
        while len(held) < 4 * LIMIT + 256:
            held.append(os.open("/dev/null", os.O_RDONLY))
            held.extend(os.pipe())
            held.extend(s.detach() for s in socket.socketpair())
    except OSError:
        pass
    n = len(held)
    for fd in held:
        os.close(fd)
    return 1 if n > LIMIT else 0
