# Attacks the grader's data: the shipped code problems with their reference solutions, read where
# the installed lockstep package keeps them (@SOLUTIONS@, anywhere under @SOLUTIONS_TREE@) and
# wherever an installed lockstep would sit under the trees the sandbox sees (site-packages and
# dist-packages under /usr and /opt). solve() returns 1 if it read a reference solution.
import glob
import json
import os

KNOWN = "@SOLUTIONS@"
PATTERNS = ["/usr/lib/python3*/*-packages/lockstep/envs/data/*.jsonl",
            "/usr/local/lib/python3*/*-packages/lockstep/envs/data/*.jsonl",
            "/opt/*/lib/python3*/site-packages/lockstep/envs/data/*.jsonl"]


def candidates():
    yield KNOWN
    for pattern in PATTERNS:
        yield from glob.glob(pattern)
    for root, _, files in os.walk("@SOLUTIONS_TREE@"):  # any copy under the tree that holds the package
        if "code_problems.jsonl" in files:
            yield os.path.join(root, "code_problems.jsonl")


def solve():
    for path in candidates():
        try:
            with open(path) as f:
                if "solution" in json.loads(f.readline()):
                    return 1
        except (OSError, ValueError):
            pass
    return 0
