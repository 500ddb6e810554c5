# Attacks the host's system files: creates files in /usr, /usr/bin, /bin, /lib and a .pth file in the
# system interpreter's site-packages (code every Python on the host would run). Only new files with
# a marker name, so that a failure of the sandbox leaves nothing harmful. solve() returns 1 if one
# was created (/usr is the host's, read-only bind: anything written there is on the host).
import sysconfig

MARKER = "@MARKER@"


def solve():
    paths = [f"/usr/{MARKER}", f"/usr/bin/{MARKER}", f"/bin/{MARKER}", f"/lib/{MARKER}", f"/usr/lib/{MARKER}",
             f"{sysconfig.get_paths()['purelib']}/{MARKER}.pth", f"{sysconfig.get_paths()['stdlib']}/{MARKER}.py"]
    for path in paths:
        try:
            with open(path, "x") as f:
                f.write("# lockstep hostile-program marker\n")
            return 1
        except OSError:
            pass
    return 0
