"""What a run config asks for, as the planner's inputs: the model's shape and one step's workload."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

from lockstep.config.types import RunSpec
from lockstep.planner.types import ModelShape, PlanRefused, Workload


def builtin_shape(lora_rank: int = 0) -> ModelShape:
    """The built-in tiny model's shape, read from `tiny_config`'s own defaults (one source of truth)."""
    from lockstep.engine.tiny import char_vocab, tiny_config

    d = {k: p.default for k, p in inspect.signature(tiny_config).parameters.items()}
    return ModelShape("builtin", num_layers=d["num_layers"], hidden=d["hidden_size"], num_heads=d["num_heads"],
                      num_kv_heads=d["num_kv_heads"], intermediate=d["intermediate_size"], vocab=len(char_vocab()),
                      tied_embeddings=True, gated_mlp=True, lora_rank=lora_rank)


def shape_from_config(path: str | Path, lora_rank: int = 0) -> ModelShape:
    """A Hugging Face config.json (or the directory holding one): Llama, Qwen2/3, Mistral and the like."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PlanRefused("model", f"cannot read a model config at {path}: {e}; pass --model-config "
                                   f"PATH to a Hugging Face config.json") from None
    cfg = cfg.get("text_config", cfg)
    experts = cfg.get("num_experts") or cfg.get("num_local_experts")
    if experts:
        raise PlanRefused("model", f"{path} is a mixture of experts ({experts} experts); the planner models "
                                   f"dense transformers only (docs/planner.md)")
    try:
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        return ModelShape(cfg.get("_name_or_path") or cfg.get("model_type", path.parent.name), num_layers=cfg["num_hidden_layers"],
                          hidden=hidden, num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads", heads),
                          intermediate=cfg["intermediate_size"], vocab=cfg["vocab_size"],
                          tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                          gated_mlp=cfg.get("hidden_act", "silu") in ("silu", "swiglu"), lora_rank=lora_rank)
    except KeyError as e:
        raise PlanRefused("model", f"{path} lacks {e.args[0]!r}: the planner needs num_hidden_layers, hidden_size, "
                                   f"num_attention_heads, intermediate_size and vocab_size") from None


def spec_shape(spec: RunSpec, model_config: str | None = None) -> ModelShape:
    if model_config:
        return shape_from_config(model_config, spec.model.lora_rank)
    if spec.model.path == "builtin":
        return builtin_shape(spec.model.lora_rank)
    return shape_from_config(spec.model.path, spec.model.lora_rank)


def prompt_tokens(spec: RunSpec) -> int | None:
    """Prompt length of the arithmetic suites: "a+b=" with operands zero-padded to env.digits, one
    token per character with the built-in byte tokenizer (at most that with a merging tokenizer);
    None where it depends on data."""
    if spec.env.name in ("arithmetic", "long_addition"):
        return 2 * spec.env.digits + 2
    return None


def completion_tokens(spec: RunSpec) -> int:
    """Tokens sampled per episode: env.max_tokens per turn (long_addition raises it to fit a worked
    answer, as its suite does)."""
    per_turn = spec.env.max_tokens
    if spec.env.name == "long_addition":
        from lockstep.envs.arithmetic import Problem

        top = 10**spec.env.digits - 1
        per_turn = max(per_turn, len(Problem(top, top, spec.env.digits, True).answer) + 8)
    return per_turn * spec.env.max_turns


def spec_workload(spec: RunSpec, *, prompt: int | None = None) -> Workload:
    """The workload of the config's first RL stage (or, with none, its first stage's SFT batch)."""
    stage = next((s for s in spec.stages if s.kind == "rl"), spec.stages[0])
    length = prompt if prompt is not None else prompt_tokens(spec)
    if length is None:
        raise PlanRefused("workload", f"the prompt length of env {spec.env.name!r} depends on its data; "
                                      f"pass --prompt-tokens N (a typical prompt's tokens)")
    if stage.kind == "sft":
        return Workload("sft", stage.batch_size, length, completion_tokens(spec))
    return Workload("rl", stage.prompts_per_step * stage.group_size, length, completion_tokens(spec),
                    group_size=stage.group_size, max_staleness=stage.max_staleness)
