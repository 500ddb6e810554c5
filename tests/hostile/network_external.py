# Attacks the network: TCP to 1.1.1.1:80 and 8.8.8.8:53 (and over IPv6), a DNS lookup, and a UDP
# DNS query to 1.1.1.1. solve() returns 1 if anything got through.
import socket

QUERY = bytes.fromhex("abcd01000001000000000000076578616d706c6503636f6d0000010001")  # A example.com


def solve():
    hits = 0
    for host, port in (("1.1.1.1", 80), ("8.8.8.8", 53), ("2606:4700:4700::1111", 80)):
        try:
            socket.create_connection((host, port), timeout=0.7).close()
            hits += 1
        except OSError:
            pass
    try:
        socket.getaddrinfo("example.com", 80)
        hits += 1
    except OSError:
        pass
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.settimeout(0.7)
        s.sendto(QUERY, ("1.1.1.1", 53))
        if s.recv(512):
            hits += 1
    except OSError:
        pass
    return 1 if hits else 0
