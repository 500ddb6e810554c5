# Attacks the kernel's network stacks: sockets of every family but AF_UNIX (IPv4 and IPv6 on the
# sandbox's loopback, netlink, raw packets, vsock to the hypervisor) and socketpair() over them.
# No route leaves the sandbox, but each family is kernel code a program can reach. solve() returns
# 1 if any such socket was created.
import socket

FAMILIES = [(name, getattr(socket, name)) for name in
            ("AF_INET", "AF_INET6", "AF_NETLINK", "AF_PACKET", "AF_VSOCK", "AF_ALG", "AF_TIPC", "AF_RDS")
            if hasattr(socket, name)]


def solve():
    opened = 0
    for _, family in FAMILIES:
        for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM, socket.SOCK_RAW, socket.SOCK_SEQPACKET):
            try:
                socket.socket(family, kind).close()
                opened += 1
            except OSError:
                pass
    try:
        a, b = socket.socketpair(socket.AF_INET)
        opened += 1
    except OSError:
        pass
    return 1 if opened else 0
