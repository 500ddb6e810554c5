# Attacks the host's network services: connects to a port the test listens on (0.0.0.0), through
# 127.0.0.1, the host's own address and ::1. The sandbox has its own loopback, so each must fail.
# solve() returns 1 if it read the listener's banner.
import socket

PORT = int("@PORT@")
TOKEN = "@TOKEN@"


def solve():
    for host in ("127.0.0.1", "@HOST_IP@", "::1", "localhost"):
        try:
            with socket.create_connection((host, PORT), timeout=0.7) as s:
                s.settimeout(0.7)
                if TOKEN.encode() in s.recv(256):
                    return 1
        except OSError:
            pass
    return 0
