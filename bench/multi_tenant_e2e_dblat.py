"""Server-side latency per call kind from a service's database, as BENCHMARKS §27 reports it.

    python bench/multi_tenant_e2e_dblat.py /tmp/lockstep-e2e-*/before/db.sqlite [...]

Created -> finished of every done forward_backward, optim_step and sample request (and the part of
it spent queued: created -> claimed), leaving out each model's and sampling session's first request
of each kind (bench/multi_tenant_e2e.py's warm-up round). The database is opened read-only.
"""

from __future__ import annotations

import sqlite3
import sys
from datetime import datetime

import numpy as np

KINDS = ("forward_backward", "optim_step", "sample")


def latencies(path: str) -> dict[str, tuple[list[float], list[float]]]:
    con = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    rows = con.execute('select kind, coalesce(model_id, sampling_session_id), created_at, claimed_at, finished_at '
                       'from requests where state = \'done\' order by "order"').fetchall()
    seen, out = set(), {k: ([], []) for k in KINDS}
    for kind, owner, created, claimed, finished in rows:
        if kind not in KINDS:
            continue
        if (kind, owner) not in seen:  # the warm-up round
            seen.add((kind, owner))
            continue
        c = datetime.fromisoformat(created).timestamp()
        out[kind][0].append(datetime.fromisoformat(finished).timestamp() - c)
        out[kind][1].append(datetime.fromisoformat(claimed).timestamp() - c)
    return out


def main() -> None:
    for path in sys.argv[1:]:
        print(path)
        for kind, (total, queued) in latencies(path).items():
            if total:
                print(f"  {kind}: n={len(total)} p50={np.percentile(total, 50):.2f}s p99={np.percentile(total, 99):.2f}s"
                      f" queued p50={np.percentile(queued, 50):.2f}s")


if __name__ == "__main__":
    main()
