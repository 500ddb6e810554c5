"""An uploaded dataset's check, in a process of its own:
`python -m lockstep.service.datacheck PATH FORMAT CAP MEMORY` answers one JSON line, {"rows": N} or
{"refused": "what is wrong"}: the file's rows within CAP decoded bytes, decoded in at most MEMORY
bytes of heap (CHECK_MEMORY_BYTES for an upload).

A dataset is checked by decoding it, and decoding is where a hostile file costs memory before any
row can be counted: one parquet page inflates to up to 2 GiB from a few KB, one jsonl line of
`[{},{},...]` takes ~25x its size once parsed, and a crafted file may crash the reader. So the API
process never decodes a tenant's file: this child does, its heap and private mappings bounded by
RLIMIT_DATA (arrow allocating through malloc, which the limit governs) and its time by
RLIMIT_CPU. Rows are counted with the jobs' own reader (envs/datafile.py), so the verdict is the
one a job's read would reach under a budget of CAP bytes.
"""

from __future__ import annotations

import json
import os
import resource
import sys

CHECK_MEMORY_BYTES = 1 << 30
"""RLIMIT_DATA of the check: the interpreter and pyarrow take ~90 MB, one batch of rows the rest."""
CHECK_CPU_S = 60
"""RLIMIT_CPU of the check: a 512 MiB decode takes a few seconds."""


def limit_self(memory: int) -> None:
    """Bound this process before it reads anything (it only ever lowers a limit)."""
    # Arrow allocates through malloc, which RLIMIT_DATA governs (its mimalloc pool reserves ~1 GB up
    # front), and runs one thread per pool, not one per core (each stack counts against the limit).
    os.environ.update(ARROW_DEFAULT_MEMORY_POOL="system", OMP_NUM_THREADS="1", ARROW_IO_THREADS="1")
    for which, soft, hard in ((resource.RLIMIT_DATA, memory, memory),
                              (resource.RLIMIT_CPU, CHECK_CPU_S, CHECK_CPU_S + 5),
                              (resource.RLIMIT_CORE, 0, 0)):
        _, hard_now = resource.getrlimit(which)
        if hard_now != resource.RLIM_INFINITY:
            soft, hard = min(soft, hard_now), min(hard, hard_now)
        resource.setrlimit(which, (soft, hard))


def check(path: str, fmt: str, cap: int, memory: int) -> dict:
    """The verdict on one file: its number of rows, or why it is refused."""
    from lockstep.envs.datafile import BATCH_ROWS, DataBudgetExceeded, iter_rows
    from lockstep.envs.types import EnvError

    rows = 0
    try:
        for row in iter_rows(path, budget_bytes=cap, fmt=fmt):
            if isinstance(row, EnvError):
                return {"refused": f"dataset {row}"}
            rows += 1
    except DataBudgetExceeded as e:
        return {"refused": f"dataset decodes to more than this server's cap max_dataset_decoded_bytes = {cap} "
                           f"bytes (past row {e.rows}; rows as Python objects, parquet dictionaries expanded)"}
    except EnvError as e:
        return {"refused": str(e).replace(path, "dataset", 1)}
    except MemoryError:
        return {"refused": f"dataset needs more than {memory} bytes of memory to decode (one parquet "
                           f"page, value or batch of {BATCH_ROWS} rows inflates past it)"}
    return {"rows": rows}


def main(argv: list[str]) -> None:
    path, fmt, cap, memory = argv
    limit_self(int(memory))
    print(json.dumps(check(path, fmt, int(cap), int(memory))), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
