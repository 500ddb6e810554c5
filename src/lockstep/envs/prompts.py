"""Prompt rendering for text-problem suites (math, reasoning_gym): a template, optionally wrapped in
the tokenizer's chat template."""

from __future__ import annotations

from collections.abc import Mapping

from lockstep.envs.types import EnvError


def _token_ids(out) -> tuple[int, ...]:
    """A flat id tuple from `apply_chat_template(tokenize=True)`: transformers 5 returns a
    BatchEncoding (a Mapping with `input_ids`), older versions a list."""
    if isinstance(out, Mapping):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if len(out) > 0 and isinstance(out[0], (list, tuple)):
        assert len(out) == 1, "one conversation in, one id list out"
        out = out[0]
    return tuple(int(t) for t in out)


def render_prompt(tokenizer, text: str, *, template: str, chat: bool) -> tuple[int, ...]:
    """Prompt tokens for a problem: `template` with {question} filled, as a user message in the
    tokenizer's chat template (with the assistant turn opened) when `chat`, else plainly encoded."""
    content = template.format(question=text)
    if not chat:
        return tuple(tokenizer.encode(content))
    out = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                        tokenize=True)
    return _token_ids(out)


def check_prompt_settings(tokenizer, *, template: str, chat: bool) -> None:
    """Fail at suite construction, not mid-run, on a template or tokenizer that cannot render."""
    try:
        template.format(question="")
    except (KeyError, IndexError, ValueError) as e:
        raise EnvError(f"env.prompt_template: {template!r} cannot be filled with only {{question}} "
                       f"({type(e).__name__}: {e}); write literal braces as {{{{ and }}}}") from None
    if chat and not getattr(tokenizer, "chat_template", None):
        raise EnvError("env.chat_template is true but the model's tokenizer has no chat template; "
                       "set env.chat_template = false or use a tokenizer that has one")
