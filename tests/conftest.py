"""Shared fixtures: tiny model directories built in code (no downloads)."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory):
    from lockstep.engine.tiny import save_model_dir, tiny_config

    cfg = tiny_config(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
    return str(save_model_dir(tmp_path_factory.mktemp("qwen2"), cfg, seed=1))


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    from lockstep.engine.tiny import save_model_dir, tiny_config

    cfg = tiny_config(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=4, intermediate_size=160,
                      architecture="llama")
    return str(save_model_dir(tmp_path_factory.mktemp("llama"), cfg, seed=2))


@pytest.fixture(scope="session")
def builtin_dir(tmp_path_factory):
    from lockstep.engine.tiny import ensure_tiny_model

    return str(ensure_tiny_model(tmp_path_factory.mktemp("home") / "tiny"))


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)
