# Attacks through native code: ctypes loads libc and calls kill() on the host's victim and system()
# to write into /usr and the host's directory; then it compiles and runs a C program (gcc is under
# the read-only /usr) that reads the host's canary. Native code is no way out of the sandbox:
# solve() returns 1 if any of it reached the host.
import ctypes
import os
import subprocess

VICTIM = int("@VICTIM_PID@")
HOST = "@HOST_TMP@"
TOKEN = "@TOKEN@"
MARKER = "@MARKER@"
C = r"""
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>
int main(int argc, char **argv) {
    char buf[256] = {0};
    int fd = open(argv[1], O_RDONLY);
    if (fd >= 0 && read(fd, buf, 255) > 0) puts(buf);
    fd = open(argv[2], O_WRONLY | O_CREAT | O_EXCL, 0644);
    if (fd >= 0) puts("WROTE");
    return 0;
}
"""


def solve():
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    won = 0
    if libc.kill(VICTIM, 0) == 0:
        won = 1
    libc.system(f"touch /usr/{MARKER}-native; echo pwned > {HOST}/canary.txt; touch {HOST}/{MARKER}-native; "
                f"kill -9 {VICTIM}".encode())
    if os.path.exists(f"/usr/{MARKER}-native"):
        won = 1
    fd = libc.open(f"{HOST}/canary.txt".encode(), os.O_RDONLY)
    if fd >= 0:
        buf = ctypes.create_string_buffer(256)
        libc.read(fd, buf, 255)
        won |= TOKEN.encode() in buf.value
    try:
        with open("/tmp/x.c", "w") as f:
            f.write(C)
        subprocess.run(["gcc", "-O0", "-o", "/tmp/x", "/tmp/x.c"], capture_output=True, timeout=2.5)
        out = subprocess.run(["/tmp/x", f"{HOST}/canary.txt", f"/usr/{MARKER}-c"], capture_output=True,
                             timeout=1).stdout
        won |= TOKEN.encode() in out or b"WROTE" in out
    except (OSError, subprocess.SubprocessError):
        pass
    return int(won)
