"""The upload's dataset check on decompression bombs and on ordinary files: verdict, wall time and
the check process's peak RSS (BENCHMARKS.md, "Dataset checks").

    .venv/bin/python bench/dataset_check.py

Each file is checked as an upload is (`service/datacheck.py` in a child, the default policy's cap
and the check's memory bound), five times; the median time and the largest peak RSS are reported.
The files are built by a process of their own: a child's peak RSS counts its parent's at the fork.
"""

from __future__ import annotations

import io
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lockstep.service.datacheck import CHECK_MEMORY_BYTES

REPEATS = 5
CAP = 512 << 20
"""The default policy's max_dataset_decoded_bytes (service/policy.py)."""


def build(tmp: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from data_bombs import parquet_bomb as bomb  # the tests' bombs

    rows = [{"problem": f"What is {i}+{i * 7}?", "answer": str(i * 8)} for i in range(500_000)]
    out = {"2 GB bomb (20k x 100 KB, dictionary array)": bomb(20_000, 100_000, arrow_schema=True),
           "20 GB bomb (200k x 100 KB, plain strings)": bomb(200_000, 100_000, arrow_schema=False)}
    buf = io.BytesIO()
    pq.write_table(pa.table({"prompt": ["y" * 100_000_000]}), buf, compression="zstd")
    out["one 100 MB value"] = buf.getvalue()
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    out["500k short rows (parquet)"] = buf.getvalue()
    out["500k short rows (jsonl)"] = "".join(json.dumps(r) + "\n" for r in rows).encode()
    out["one row (jsonl): the process alone"] = b'{"problem": "1+1", "answer": "2"}\n'
    for i, (name, data) in enumerate(out.items()):
        (tmp / f"{i}.{'jsonl' if 'jsonl' in name else 'parquet'}").write_bytes(data)
    (tmp / "names.json").write_text(json.dumps(list(out)))


def check(path: Path, cap: int) -> tuple[str, float, int]:
    """(verdict, seconds, peak RSS in bytes) of one check."""
    fmt = path.suffix.lstrip(".")
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-B", "-m", "lockstep.service.datacheck", str(path), fmt, str(cap),
                             str(CHECK_MEMORY_BYTES)], stdout=subprocess.PIPE)
    out = proc.stdout.read()
    _, _, usage = os.wait4(proc.pid, 0)
    return out.decode().strip(), time.perf_counter() - start, usage.ru_maxrss * 1024


def main() -> None:
    from lockstep.service.policy import Limits

    assert Limits().max_dataset_decoded_bytes == CAP
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, __file__, "--build", tmp], check=True)
        for i, name in enumerate(json.loads((Path(tmp) / "names.json").read_text())):
            path = next(Path(tmp).glob(f"{i}.*"))
            runs = [check(path, CAP) for _ in range(REPEATS)]
            verdict = json.loads(runs[0][0])
            shown = f"{verdict['rows']} rows" if "rows" in verdict else verdict["refused"][:60] + "..."
            print(f"| {name} | {path.stat().st_size:,} B | {shown} | {statistics.median(r[1] for r in runs):.2f} s "
                  f"| {max(r[2] for r in runs) / 2**20:.0f} MiB |")


if __name__ == "__main__":
    build(Path(sys.argv[2])) if sys.argv[1:2] == ["--build"] else main()
