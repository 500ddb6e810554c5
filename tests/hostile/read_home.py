# Attacks the user's home: lists /root, the host user's $HOME and /home, and reads the usual secrets
# in it (shell history, SSH keys, tokens). solve() returns 1 if it saw anything there.
import os

HOME = "@HOST_HOME@"


def solve():
    for d in ("/root", HOME, "/home"):
        try:
            if os.listdir(d):
                return 1
        except OSError:
            pass
    for name in (".bash_history", ".ssh/id_rsa", ".ssh/id_ed25519", ".cache/huggingface/token", ".netrc", ".bashrc",
                 ".profile"):
        for d in ("/root", HOME):
            try:
                with open(os.path.join(d, name), "rb") as f:
                    f.read(1)
                return 1
            except OSError:
                pass
    return 0
