# Attacks memory through System V message queues: messages live in the IPC namespace, in no
# process's address space or resident set (up to msgmnb x msgmni, ~500 MiB), so neither RLIMIT_AS
# nor the tree's memory watch sees them. solve() returns 1 if it queued more than the sandbox's
# whole memory bound (@SANDBOX_MEMORY_MB@ MiB) at once (and removes its queues before it returns).
import ctypes

BOUND = int("@SANDBOX_MEMORY_MB@") << 20
IPC_PRIVATE, IPC_CREAT, IPC_NOWAIT, IPC_RMID = 0, 0o1000, 0o4000, 0
SIZE = 8000  # under msgmax (8192)


class Msg(ctypes.Structure):
    _fields_ = [("mtype", ctypes.c_long), ("mtext", ctypes.c_char * SIZE)]


def solve():
    libc = ctypes.CDLL(None, use_errno=True)
    msg, queues, held = Msg(1, b"x" * SIZE), [], 0
    try:
        while held <= BOUND:
            q = libc.msgget(IPC_PRIVATE, IPC_CREAT | 0o600)
            if q < 0:
                break
            queues.append(q)
            sent = 0
            while libc.msgsnd(q, ctypes.byref(msg), SIZE, IPC_NOWAIT) == 0:
                sent += SIZE
            held += sent
            if not sent:
                break
        return 1 if held > BOUND else 0
    finally:
        for q in queues:
            libc.msgctl(q, IPC_RMID, None)
