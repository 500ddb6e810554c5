# Attacks host services over Unix sockets: an abstract-namespace socket and a socket file in the
# host's directory, both listened on by the test. solve() returns 1 if it read the banner.
import socket

TOKEN = "@TOKEN@"


def solve():
    for address in ("\0@ABSTRACT@", "@HOST_TMP@/host.sock"):
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(0.7)
                s.connect(address)
                if TOKEN.encode() in s.recv(256):
                    return 1
        except OSError:
            pass
    return 0
