"""Local stand-ins for what tinker-cookbook's recipes download: small models under the hub names the
recipes look up, and Hugging Face datasets seeded into an offline `datasets` cache.

The recipes load `model_name`'s tokenizer with `AutoTokenizer.from_pretrained(model_name)`, which
reads a local directory of that relative path first, and pick a renderer from the hub name
(tinker_cookbook.model_info). So a recipe runs in a directory holding `Qwen/Qwen3-8B-Base/` (a model
and tokenizer built here, no download) against a server that registered that directory under the
same name. Datasets: `load_dataset(repo, config)` with HF_DATASETS_OFFLINE=1 reads the newest
prepared copy under $HF_HOME/datasets/<org>___<name>/<config>/, which `seed_dataset` writes with
datasets' own Parquet builder. Nothing here changes a recipe: only where its inputs come from.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

CHAT_SPECIAL = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>",
                "</tool_call>", "<tool_response>", "</tool_response>")
"""Qwen chat-template tokens, one id each (the qwen3* renderers assert <|im_end|> is one token)."""
QWEN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chat_tokenizer():
    """The built-in character tokenizer plus Qwen's chat tokens and a chat template."""
    from lockstep.engine.tiny import build_char_tokenizer

    tok = build_char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": list(CHAT_SPECIAL)})
    tok.chat_template = QWEN_TEMPLATE
    return tok


def model_dir(root: Path, name: str, *, seed: int = 0, max_position: int = 2048, chat: bool = False,
              hidden_size: int = 64, num_layers: int = 2) -> Path:
    """A small Qwen2-architecture model saved at root/name (name is the hub name a recipe uses)."""
    import torch
    from transformers import AutoModelForCausalLM

    from lockstep.engine.tiny import build_char_tokenizer, tiny_config

    path = root / name
    if (path / "config.json").exists():
        return path
    tok = chat_tokenizer() if chat else build_char_tokenizer()
    cfg = tiny_config(hidden_size=hidden_size, num_layers=num_layers, num_heads=4, num_kv_heads=2,
                      intermediate_size=2 * hidden_size, max_position_embeddings=max_position)
    cfg.vocab_size = len(tok)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def seed_dataset(hf_home: Path, repo: str, splits: dict[str, list[dict]], config: str = "default") -> None:
    """Make `load_dataset(repo, config)` work offline: prepare `splits` with datasets' Parquet
    builder and place the result where datasets' offline cache lookup finds `repo`
    (CachedDatasetModuleFactory: $HF_HOME/datasets/<org>___<name>/<config>/<version>/<hash>/)."""
    import datasets
    from datasets.packaged_modules.parquet.parquet import Parquet
    from datasets.naming import camelcase_to_snakecase

    org, name = repo.split("/")
    work = hf_home / "build" / repo.replace("/", "__") / config
    work.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, rows in splits.items():
        files[split] = str(work / f"{split}.parquet")
        datasets.Dataset.from_list(rows).to_parquet(files[split])
    builder = Parquet(cache_dir=str(work / "prepared"), dataset_name=camelcase_to_snakecase(name),
                      config_name=config, data_files=files, hash="local")
    builder.download_and_prepare()
    dest = hf_home / "datasets" / f"{org}___{camelcase_to_snakecase(name)}" / config / "0.0.0" / "local"
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(builder.cache_dir, dest)
    info = json.loads((dest / "dataset_info.json").read_text())
    assert info["config_name"] == config, info["config_name"]


def _sums(n: int, offset: int = 0) -> list[tuple[int, int]]:
    return [((7 * i + offset) % 50, (3 * i + 1) % 50) for i in range(n)]


def gsm8k_rows(n: int, offset: int = 0) -> list[dict]:
    """GSM8K's fields: a question and a worked answer ending in '#### <number>'."""
    return [{"question": f"Tom has {a} apples and buys {b} more. How many apples does he have?",
             "answer": f"Tom has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n#### {a + b}"}
            for a, b in _sums(n, offset)]


def chat_rows(n: int, offset: int = 0) -> list[dict]:
    """No Robots' fields: prompt, prompt_id, messages, category."""
    rows = []
    for i, (a, b) in enumerate(_sums(n, offset)):
        q, ans = f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
        rows.append({"prompt": q, "prompt_id": f"p{offset + i}", "category": "Math",
                     "messages": [{"role": "user", "content": q}, {"role": "assistant", "content": ans}]})
    return rows


def hh_rows(n: int, offset: int = 0) -> list[dict]:
    """Anthropic HH-RLHF's fields: chosen and rejected transcripts sharing their prompt."""
    out = []
    for a, b in _sums(n, offset):
        prompt = f"\n\nHuman: What is {a} plus {b}?\n\nAssistant:"
        out.append({"chosen": f"{prompt} It is {a + b}.", "rejected": f"{prompt} It is {a + b + 1}."})
    return out


def deepmath_rows(n: int) -> list[dict]:
    return [{"question": f"Compute {a} + {b}.", "final_answer": str(a + b), "difficulty": 1.0, "topic": "arith"}
            for a, b in _sums(n)]


def deepcoder_rows(n: int, offset: int = 0) -> list[dict]:
    """DeepCoder's fields (LiveCodeBench format): a problem, its stdin/stdout tests, metadata."""
    rows = []
    for a, _ in _sums(n, offset):
        tests = [{"input": f"{x}\n", "output": f"{x + a}\n", "testtype": "stdin_stdout"} for x in (1, 2)]
        rows.append({"problem": f"Read an integer x from stdin and print x + {a}.", "tests": json.dumps(tests),
                     "metadata": "{}", "starter_code": ""})
    return rows


def seed_all(hf_home: Path) -> None:
    """Every dataset the tested recipes load, small."""
    seed_dataset(hf_home, "openai/gsm8k", {"train": gsm8k_rows(64), "test": gsm8k_rows(8, 1)}, "main")
    seed_dataset(hf_home, "HuggingFaceH4/no_robots", {"train": chat_rows(64), "test": chat_rows(8, 1)})
    seed_dataset(hf_home, "Anthropic/hh-rlhf", {"train": hh_rows(64), "test": hh_rows(8, 1)})
    seed_dataset(hf_home, "zwhe99/DeepMath-103K", {"train": deepmath_rows(32)})
    for config in ("primeintellect", "taco", "lcbv5", "codeforces"):
        seed_dataset(hf_home, "agentica-org/DeepCoder-Preview-Dataset",
                     {"train": deepcoder_rows(8), "test": deepcoder_rows(4, 1)}, config)


def wikitext_rows(num_lines: int, seed: int = 0) -> list[dict]:
    """WikiText's one field, `text`: synthetic English-like lines (rl_numerics_check counts words
    from its DEFAULT_WORDS in them), with WikiText's blank and heading lines among them."""
    import random

    from tinker_cookbook.recipes.rl_numerics_check.env import DEFAULT_WORDS

    rng = random.Random(seed)
    filler = ("the river city was built near old stone walls and the people of the valley traded grain "
              "salt iron wool and wine across the northern roads").split()
    rows = []
    for i in range(num_lines):
        if i % 20 == 0:
            rows.append({"text": f" = Section {i // 20} = \n"})
            continue
        words = [rng.choice(DEFAULT_WORDS) if rng.random() < 0.1 else rng.choice(filler) for _ in range(30)]
        rows.append({"text": " " + " ".join(words).capitalize() + " . \n"})
    return rows


TOOL_CALL_PAGE = 1
"""The page the tool-calling model always asks for: it only has to keep the episode going."""


def tool_caller_dir(root: Path, name: str, *, renderer_name: str = "qwen3_5_disable_thinking",
                    max_position: int = 8192, steps: int = 300, tail: int = 8192, seed: int = 0) -> Path:
    """A small chat model that answers every turn of rl_numerics_check's episode with one
    read_page call, so episodes run many turns into long contexts (a random model never makes a
    tool call and ends each episode at its first turn). Trained here, in-process, with lockstep's
    own Trainer on transcripts rendered by the cookbook's renderer for the recipe's own env, then
    saved as an ordinary model directory under `name`."""
    import json as _json
    import random

    from tinker_cookbook import renderers
    from tinker_cookbook.recipes.rl_numerics_check.env import CountingTaskConfig, build_env, sample_problem
    from tinker_cookbook.renderers import TrainOnWhat
    from tinker_cookbook.renderers.base import ToolCall

    from lockstep.engine.trainer import Trainer
    from lockstep.engine.types import AdamParams, Datum

    path = root / name
    if (path / "lockstep_tool_caller.json").exists():
        return path
    base = model_dir(root / "untrained", name, seed=seed, max_position=max_position, chat=True)
    tok = chat_tokenizer()
    renderer = renderers.get_renderer(renderer_name, tok)
    corpus = "\n".join(r["text"].strip() for r in wikitext_rows(4000, seed) if r["text"].strip())
    task = CountingTaskConfig(num_pages_min=2, num_pages_max=4, page_chars=200)
    rng = random.Random(seed)
    call = ToolCall(function=ToolCall.FunctionBody(name="read_page", arguments=_json.dumps({"page": TOOL_CALL_PAGE})))

    def transcript() -> Datum:
        problem = sample_problem(rng, corpus, task)
        env = build_env(problem, renderer, task, max_trajectory_tokens=None, max_generation_tokens=None)
        messages = list(env.message_env.initial_messages)
        for _ in range(rng.randint(1, 3)):
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            messages.append({"role": "tool", "content": f"[Page 1]\n{problem.pages[0]}", "name": "read_page",
                             "tool_call_id": "call"})
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        model_input, weights = renderer.build_supervised_example(messages, TrainOnWhat.LAST_ASSISTANT_MESSAGE)
        # Whole transcripts (2-3K tokens): a model trained on 192-token tails wrote the call there
        # but not after the recipe's 1.9K-token first prompt (measured, docs/cookbook.md).
        tokens, weights = model_input.to_ints()[-tail:], [float(w) for w in weights][-tail:]
        return Datum.from_tokens(tokens, weights=weights[1:])

    trainer = Trainer.from_pretrained(str(base))
    adam = AdamParams(learning_rate=1e-2, beta2=0.99, eps=1e-8, grad_clip_norm=1.0)
    for _ in range(steps):
        data = [transcript() for _ in range(8)]
        out = trainer.forward_backward(data, "cross_entropy")
        trainer.optim_step(adam)
        if out.metrics["loss:sum"] / sum(float(d.loss_fn_inputs["weights"].sum()) for d in data) < 2e-3:  # mean NLL per trained token: ~85 call tokens sampled at temperature 1 then keep the call ~85% of turns
            break
    trainer.save_weights_for_sampler(path, kind="merged")
    tok.save_pretrained(path)
    (path / "lockstep_tool_caller.json").write_text(_json.dumps({"renderer": renderer_name, "page": TOOL_CALL_PAGE}))
    return path
