"""tinker-cookbook 0.6.1's recipes, run unchanged (`python -m tinker_cookbook.recipes...`) against a
live `lockstep serve`, for a few steps each.

What changes is only what a user of a self-hosted server changes: command-line arguments (base_url,
model_name, sizes: batch, group, steps, max_tokens, lora_rank to fit the small models; a local file
path), the SDK's environment (TINKER_BASE_URL, TINKER_API_KEY) and where data comes from: the
recipes' Hugging Face datasets are seeded into an offline `datasets` cache, and their hub model
names are small local models (tests/cookbook_data.py). docs/cookbook.md has the table.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

import cookbook_data as cd
from test_service_sdk import free_port, make_server

pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")]
pytest.importorskip("tinker_cookbook")

STUDENT = "Qwen/Qwen3-8B-Base"  # model_info: role_colon renderer, any tokenizer
TEACHER = "Qwen/Qwen3-8B"
CHAT = "Qwen/Qwen3.5-4B"  # multiplayer_rl's default (qwen3_5_disable_thinking)
CHAT_9B = "Qwen/Qwen3.5-9B"  # code_rl's default and twenty_questions' answerer (qwen3_5)
PROMPT_DISTILL = "Qwen/Qwen3.6-35B-A3B"  # prompt_distillation's create_data hard-codes it
SIZES = ("max_steps=2", "eval_every=0")


@dataclass
class Cook:
    url: str
    run_dir: Path
    env: dict
    tmp: Path

    def run(self, module: str, *args: str, log: str, extra_env: dict | None = None, log_arg: bool = True) -> list[dict]:
        """Run a recipe's CLI to completion (with log_path= under tmp unless `log_arg` is False);
        its metrics.jsonl records."""
        log_path = self.tmp / "logs" / log
        cmd = [sys.executable, "-m", module, *args, *([f"log_path={log_path}"] if log_arg else [])]
        r = subprocess.run(cmd, cwd=self.run_dir, env={**self.env, **(extra_env or {})}, capture_output=True,
                           text=True, timeout=1800)
        assert r.returncode == 0, (r.stdout[-2000:], r.stderr[-4000:])
        path = log_path / "metrics.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def cook(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cookbook")
    run_dir, hf_home = tmp / "run", tmp / "hf"
    models = {STUDENT: cd.model_dir(run_dir, STUDENT), TEACHER: cd.model_dir(run_dir, TEACHER, seed=1),
              CHAT: cd.model_dir(run_dir, CHAT, chat=True, seed=2),
              CHAT_9B: cd.model_dir(run_dir, CHAT_9B, chat=True, seed=3, max_position=8192),
              PROMPT_DISTILL: cd.model_dir(run_dir, PROMPT_DISTILL, chat=True, seed=4)}
    cd.seed_all(hf_home)
    srv = make_server(tmp, [f"{name}={path}" for name, path in models.items()])
    key = srv.key("cook")
    srv.start()
    env = {**srv.env, "TINKER_API_KEY": key, "TINKER_BASE_URL": srv.url, "HF_HOME": str(hf_home),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    yield Cook(srv.url, run_dir, env, tmp)
    srv.stop()


def kl_values(metrics: list[dict]) -> list[tuple[float, float]]:
    return [(m["optim/kl_sample_train_v1"], m["optim/kl_sample_train_v2"]) for m in metrics
            if "optim/kl_sample_train_v1" in m]


def assert_kl_zero(metrics: list[dict], steps: int) -> None:
    """The cookbook's own sampler/trainer consistency metrics: exactly 0.0 at every step."""
    kls = kl_values(metrics)
    assert len(kls) == steps, metrics
    assert all(v1 == 0.0 and v2 == 0.0 for v1, v2 in kls), kls


def test_rl_basic(cook):
    """GSM8K (seeded locally) through rl.train; the builder is named on the command line only to
    set its sizes (chz cannot override a sub-field of the recipe's built value)."""
    metrics = cook.run("tinker_cookbook.recipes.rl_basic", f"base_url={cook.url}", f"model_name={STUDENT}",
                       "dataset_builder=tinker_cookbook.recipes.math_rl.math_env:Gsm8kDatasetBuilder",
                       "dataset_builder.batch_size=2", "dataset_builder.group_size=2",
                       f"dataset_builder.model_name_for_tokenizer={STUDENT}", "dataset_builder.renderer_name=role_colon",
                       "max_tokens=8", "max_steps=2", log="rl_basic")
    assert_kl_zero(metrics, 2)


def test_rl_loop(cook):
    """The minimal loop; its default stable_reinforce loss is pending (issue 29, another part),
    so it runs with the override loss_fn=importance_sampling."""
    log = cook.tmp / "logs" / "rl_loop"
    metrics = cook.run("tinker_cookbook.recipes.rl_loop", f"base_url={cook.url}", f"model_name={STUDENT}",
                       "batch_size=2", "group_size=2", "max_tokens=8", "max_steps=2", "loss_fn=importance_sampling",
                       log="rl_loop")
    assert [m["progress/batch"] for m in metrics] == [0, 1]
    final = json.loads((log / "checkpoints.jsonl").read_text().splitlines()[-1])
    assert final["state_path"].startswith("tinker://") and final["state_path"].endswith("/weights/final")


def test_sl_basic(cook):
    """The cookbook's own example conversations, the dataset swap its source documents."""
    import tinker_cookbook

    data = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    metrics = cook.run("tinker_cookbook.recipes.sl_basic", f"base_url={cook.url}", f"model_name={STUDENT}",
                       "dataset_builder=tinker_cookbook.supervised.data:FromConversationFileBuilder",
                       f"dataset_builder.file_path={data}", f"dataset_builder.common_config.model_name_for_tokenizer={STUDENT}",
                       "dataset_builder.common_config.renderer_name=role_colon",
                       "dataset_builder.common_config.max_length=1024", "dataset_builder.common_config.batch_size=32",
                       "dataset_builder.test_size=16", log="sl_basic")
    train = [m for m in metrics if "train_mean_nll" in m]
    assert len(train) == 3 and all(math.isfinite(m["train_mean_nll"]) for m in train)  # 112 rows / 32


def test_sl_loop(cook):
    metrics = cook.run("tinker_cookbook.recipes.sl_loop", f"base_url={cook.url}", f"model_name={STUDENT}",
                       "batch_size=16", "max_length=512", "max_steps=2", log="sl_loop")
    assert len(metrics) == 2 and all(math.isfinite(m["train_mean_nll"]) for m in metrics)


def test_dpo(cook):
    """DPO through forward_backward_custom: at step 0 the policy is the reference, and lockstep's
    forward gives both the same logprobs bit for bit, so the margin is exactly 0 and the loss
    exactly log 2; the step then moves the policy."""
    metrics = cook.run("tinker_cookbook.recipes.preference.dpo.train", f"base_url={cook.url}",
                       f"model_name={STUDENT}", "dataset=hhh", "batch_size=8", "max_length=512", "max_steps=2",
                       log="dpo")
    first, second = metrics[0], metrics[1]
    assert first["margin"] == 0.0 and first["chosen_reward"] == 0.0 and first["rejected_reward"] == 0.0
    assert first["dpo_loss"] == pytest.approx(math.log(2), abs=1e-7)
    assert second["margin"] != 0.0


def test_on_policy_distillation(cook):
    """The student samples, a teacher (another base model) scores with compute_logprobs."""
    metrics = cook.run("tinker_cookbook.recipes.distillation.on_policy_distillation", f"base_url={cook.url}",
                       f"model_name={STUDENT}", f"teacher_model={TEACHER}", "dataset=deepmath", "groups_per_batch=2",
                       "group_size=2", "max_tokens=8", "max_steps=2", "lora_rank=32", log="distillation")
    assert_kl_zero(metrics, 2)
    assert all(m["teacher_kl"] > 0 for m in metrics if "teacher_kl" in m)  # a different model's logprobs


def test_prompt_distillation(cook):
    """Step 1 (create_data: the teacher samples labels) unchanged, on a short local copy of the
    sentence file it reads from its working directory; step 2 (train) on a labelled file."""
    (cook.run_dir / "tinker_cookbook" / "example_data").mkdir(parents=True, exist_ok=True)
    (cook.run_dir / "tinker_cookbook" / "example_data" / "multilingual.txt").write_text(
        "Bonjour tout le monde.\nHello world.\n")
    out = cook.tmp / "prompt_distillation.jsonl"
    cook.run("tinker_cookbook.recipes.prompt_distillation.create_data", f"output_file={out}", log="pd_create",
             log_arg=False)
    assert out.exists()  # rows only where the (random) teacher wrote "Final Answer: xx"
    data = cook.tmp / "pd_train.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": s}, {"role": "assistant", "content": l}]})
                            + "\n" for s, l in [("Bonjour.", "fr"), ("Hello.", "en"), ("Hola.", "es"), ("Hallo.", "de")] * 4))
    metrics = cook.run("tinker_cookbook.recipes.prompt_distillation.train", f"base_url={cook.url}",
                       f"model_name={STUDENT}", f"file_path={data}", "batch_size=8", "num_epochs=1", "max_length=256",
                       "lora_rank=32", "eval_every=0", log="pd_train")
    assert len([m for m in metrics if "train_mean_nll" in m]) == 2


@pytest.mark.parametrize("game", ["guess_number", "twenty_questions"])
def test_multiplayer_rl(cook, game):
    """No base_url argument in these recipes: the SDK reads TINKER_BASE_URL."""
    metrics = cook.run(f"tinker_cookbook.recipes.multiplayer_rl.{game}.train", "batch_size=2", "group_size=2",
                       "max_tokens=8", *SIZES, log=game)
    assert_kl_zero(metrics, 2)


@pytest.fixture(scope="module")
def fusion_url():
    """lockstep's sandbox behind SandboxFusion's /run_code, as `lockstep sandbox fusion` serves it."""
    import uvicorn

    from lockstep.sandbox.bwrap import check_available
    from lockstep.sandbox.cookbook import fusion_app

    check_available()
    server = uvicorn.Server(uvicorn.Config(fusion_app(), host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:  # uvicorn sets it once it listens
        thread.join(0.05)
    yield f"http://127.0.0.1:{server.config.port}/run_code"
    server.should_exit = True
    thread.join()


def test_code_rl(cook, fusion_url):
    """code_rl's default sandbox backend (SandboxFusion), served by lockstep's bubblewrap sandbox."""
    metrics = cook.run("tinker_cookbook.recipes.code_rl.train", f"base_url={cook.url}", f"model_name={CHAT_9B}",
                       "groups_per_batch=2", "group_size=2", "max_tokens=32", "lora_rank=32", "max_steps=1",
                       "eval_every=0", "save_every=0", log="code_rl", extra_env={"SANDBOX_URL": fusion_url})
    assert_kl_zero(metrics, 1)


NUMERICS_MODEL = "Qwen/Qwen3.6-27B"
"""A qwen3_5-renderer name; the recipe's README quotes kl_sample_train_v1 ~0.0002 for it (dense)."""


@pytest.mark.parametrize("page_chars,pages", [(200, "4"), (600, "8")])
def test_rl_numerics_check(cook, tmp_path_factory, page_chars, pages):
    """The cookbook's rl_numerics_check, unchanged: multi-turn read_page episodes on (seeded)
    WikiText, to the model's context limit (max_trajectory_tokens = its 8192 positions), at two
    page sizes. A model trained here to call read_page every turn keeps the episodes going (a
    random model never calls a tool). optim/kl_sample_train_v1 and _v2 read exactly 0.0 at every
    step and depth, where the README calls ~0.0002 (dense) and 0.001-0.002 (MoE) healthy."""
    root = tmp_path_factory.getbasetemp() / "numerics"
    model = cd.tool_caller_dir(root, NUMERICS_MODEL)
    hf_home = Path(cook.env["HF_HOME"])
    if not (hf_home / "datasets" / "Salesforce___wikitext").exists():
        cd.seed_dataset(hf_home, "Salesforce/wikitext", {"train": cd.wikitext_rows(6000)}, "wikitext-103-raw-v1")
    srv = make_server(root / f"srv{page_chars}", [f"{NUMERICS_MODEL}={model}"])
    key = srv.key("numerics")
    srv.start()
    try:
        run = Cook(srv.url, root, {**cook.env, "TINKER_API_KEY": key, "TINKER_BASE_URL": srv.url}, cook.tmp)
        metrics = run.run("tinker_cookbook.recipes.rl_numerics_check.train", f"base_url={srv.url}",
                          f"model_name={NUMERICS_MODEL}", "renderer_name=qwen3_5_disable_thinking",
                          "group_size=2", "groups_per_batch=2", "max_tokens=96", "max_trajectory_tokens=8192",
                          f"task.page_chars={page_chars}", f"task.num_pages_min={pages}",
                          f"task.num_pages_max={pages}", "max_steps=2", "save_every=0", log=f"numerics_{page_chars}")
    finally:
        srv.stop()
    assert_kl_zero(metrics, 2)
    turns = [m["env/all/turns_per_episode"] for m in metrics if "env/all/turns_per_episode" in m]
    assert turns and min(turns) > 2, metrics  # multi-turn: the tool calls kept the episodes going
