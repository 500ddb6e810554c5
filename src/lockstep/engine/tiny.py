"""The built-in tiny model: a Qwen2-architecture causal LM with a character-level tokenizer.

Both are built in code (no download) and saved as an ordinary Hugging Face directory, so the same
loading path (`engine.loading.load_model`) serves it and real models alike.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

TINY_NAME = "lockstep/tiny"
SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
BYTE_OFFSET = len(SPECIAL_TOKENS)  # token id of byte b is b + BYTE_OFFSET


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-to-printable-char map, which the ByteLevel pre-tokenizer and decoder use."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return dict(zip(bs, map(chr, cs)))


def char_vocab() -> dict[str, int]:
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    b2u = _bytes_to_unicode()
    for b in range(256):
        vocab[b2u[b]] = len(vocab)
    return vocab


def build_char_tokenizer():
    """One token per byte (so per character for ASCII), as a byte-level BPE with no merges.

    That is the same file format as GPT-2/Qwen2 tokenizers, so `AutoTokenizer` loads it faithfully
    whichever tokenizer class transformers maps the model type to.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(vocab=char_vocab(), merges=[], unk_token=None))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        pad_token="<pad>",
        clean_up_tokenization_spaces=False,
    )


def tiny_config(
    *,
    hidden_size: int = 128,
    num_layers: int = 5,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 512,
    max_position_embeddings: int = 512,
    architecture: str = "qwen2",
):
    """A small config of the Qwen2 (default) or Llama architecture over the character vocabulary."""
    from transformers import LlamaConfig, Qwen2Config

    vocab = char_vocab()
    common = dict(
        vocab_size=len(vocab),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=vocab["<bos>"],
        eos_token_id=vocab["<eos>"],
        pad_token_id=vocab["<pad>"],
        hidden_act="silu",
    )
    if architecture == "qwen2":
        return Qwen2Config(rope_theta=10000.0, **common)
    if architecture == "llama":
        return LlamaConfig(rope_theta=10000.0, attention_bias=False, **common)
    raise ValueError(f"tiny_config: architecture must be 'qwen2' or 'llama', got {architecture!r}")


def save_model_dir(path: str | os.PathLike, config, *, seed: int = 0) -> Path:
    """Initialise a model from `config` with `seed` and save it, with the char tokenizer, as an HF dir."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path, safe_serialization=True)
    build_char_tokenizer().save_pretrained(path)
    return path


def default_tiny_dir() -> Path:
    """Where the built-in model lives: $LOCKSTEP_HOME/models/tiny (default ~/.cache/lockstep)."""
    home = Path(os.environ.get("LOCKSTEP_HOME", Path.home() / ".cache" / "lockstep"))
    return home / "models" / "tiny"


def ensure_tiny_model(path: str | os.PathLike | None = None) -> Path:
    """Build the built-in tiny model once (deterministic: seed 0) and return its directory."""
    path = Path(path) if path is not None else default_tiny_dir()
    marker = path / "lockstep_tiny.json"
    if marker.exists():
        return path
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    save_model_dir(tmp, tiny_config(), seed=0)
    (tmp / "lockstep_tiny.json").write_text(json.dumps({"name": TINY_NAME}))
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, path)
    except OSError:  # another process won the race; its copy is identical
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return path
