"""The cookbook's arithmetic rl.train (examples/cookbook_rl_arithmetic.py) in async mode, whose
loss is `AsyncConfig.loss_fn` (default "stable_reinforce"): `--loss-fn default` keeps the
cookbook's default, anything else is the one override a user makes. Run by
tests/test_service_stability.py against a live server."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import chz
from tinker_cookbook.rl import train

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import cookbook_rl_arithmetic  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--log-path", required=True)
    ap.add_argument("--loss-fn", required=True)
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    example = argparse.Namespace(model="lockstep/tiny", groups=2, group_size=4, max_tokens=8, learning_rate=1e-3,
                                 lora_rank=8, **vars(args))
    extra = {} if args.loss_fn == "default" else {"loss_fn": args.loss_fn}
    config = chz.replace(cookbook_rl_arithmetic.config(example),
                         async_config=train.AsyncConfig(max_steps_off_policy=1, groups_per_batch=2, **extra))
    asyncio.run(train.main(config))


if __name__ == "__main__":
    main()
