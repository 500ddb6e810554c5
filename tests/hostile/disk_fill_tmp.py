# Attacks disk space: fills the private /tmp past its size (tmpfs_mb), file by file under the
# file-size limit. solve() returns 1 only if it stored more than tmpfs_mb there.

TMPFS = int("@TMPFS_MB@")


def solve():
    total, chunk = 0, b"z" * (1 << 20)
    for i in range(3 * TMPFS):
        try:
            with open(f"/tmp/fill-{i}", "wb") as f:
                for _ in range(4):
                    f.write(chunk)
                    f.flush()
                    total += 1
        except OSError:
            if total > 0 and i > 0:
                break
    return 1 if total > TMPFS else 0
