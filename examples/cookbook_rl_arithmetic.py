"""tinker-cookbook's `rl.train` with its arithmetic environment, against a self-hosted lockstep.

    lockstep serve &                                  # in another shell (or any reachable server)
    TINKER_API_KEY=tml-... python examples/cookbook_rl_arithmetic.py --base-url http://127.0.0.1:8000 \\
        --tokenizer ~/.cache/lockstep/models/tiny --log-path /tmp/cookbook-run

The cookbook is installed with `pip install --no-deps tinker-cookbook==0.6.1` plus its real
dependencies (scripts/setup.sh does this): its `tml-renderers` requirement only matters for
Inkling and Kimi models. The built-in model has no chat template, so the generic `role_colon`
renderer is used, with the tiny model's local tokenizer directory as `model_name_for_tokenizer`
(no hub access is needed). `model_name` is the server's base-model name, `lockstep/tiny`, which is
registered with the cookbook's tokenizer registry so that its hub lookup never happens.
"""

from __future__ import annotations

import argparse
import asyncio

import chz  # noqa: F401  (the cookbook's config system; imported so a missing install fails here)
from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticDatasetBuilder
from tinker_cookbook.rl import train
from tinker_cookbook.tokenizer_utils import register_tokenizer


def config(args) -> train.Config:
    from transformers import AutoTokenizer

    # The recipe loads `model_name`'s tokenizer from the hub; point that name at the local one.
    register_tokenizer(args.model, lambda: AutoTokenizer.from_pretrained(args.tokenizer))
    dataset = ArithmeticDatasetBuilder(batch_size=args.groups, model_name_for_tokenizer=args.tokenizer,
                                       renderer_name="role_colon", n_batches=args.steps, group_size=args.group_size,
                                       include_fewshot=True)
    return train.Config(learning_rate=args.learning_rate, dataset_builder=dataset, model_name=args.model,
                        recipe_name="lockstep_cookbook_arithmetic", max_tokens=args.max_tokens, log_path=args.log_path,
                        renderer_name="role_colon", lora_rank=args.lora_rank, loss_fn="importance_sampling",
                        eval_every=0, save_every=args.steps, base_url=args.base_url)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--tokenizer", required=True, help="local tokenizer directory of the base model")
    ap.add_argument("--model", default="lockstep/tiny")
    ap.add_argument("--log-path", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--learning-rate", type=float, default=1e-3)
    ap.add_argument("--lora-rank", type=int, default=8)
    asyncio.run(train.main(config(ap.parse_args())))


if __name__ == "__main__":
    main()
