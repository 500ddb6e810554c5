"""Tests for lockstep.engine.checkpoint_io: atomic, verified, pickle-free checkpoint directories."""

from __future__ import annotations

import hashlib
import json
import os
import random
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from lockstep.engine import checkpoint_io as cio
from lockstep.engine.checkpoint_io import (
    CheckpointError,
    clean_stale_temps,
    is_complete,
    read_checkpoint,
    read_file,
    restore_rng_state,
    rng_state_tensors,
    verify_checkpoint,
    write_checkpoint,
)


def _bits(t: torch.Tensor) -> bytes:
    """Raw bytes of a tensor, so NaN payloads and -0.0 are compared exactly."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert tuple(a[k].shape) == tuple(b[k].shape), k
        assert _bits(a[k]) == _bits(b[k]), k


def _sample_tensors() -> dict[str, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234)
    w = torch.randn(4, 6, generator=g)
    w[0, 0], w[0, 1], w[0, 2] = float("nan"), -0.0, float("inf")
    return {
        "model": {
            "w": w,
            "w_t": w.t(),  # non-contiguous view of the same storage
            "b": torch.randn(6, generator=g, requires_grad=True),
            "bf16": torch.randn(3, 5, generator=g).to(torch.bfloat16),
            "scalar": torch.tensor(2.5, dtype=torch.float32),
        },
        "optimizer": {
            "step": torch.tensor([7, -(2**62), 2**62], dtype=torch.int64),
            "exp_avg": torch.randn(4, 6, generator=g),
            "empty": torch.zeros(0, 3),
        },
        "bytes": {"u8": torch.arange(256, dtype=torch.uint8).reshape(16, 16)},
    }


META = {"step": 100, "run": "demo", "lr": 3e-4, "nested": {"seeds": [1, 2, 3], "ok": True}}


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return write_checkpoint(tmp_path / "step-100", tensors=_sample_tensors(), meta=META,
                            files={"config.json": b'{"hidden": 8}'})


def _hidden(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


# ------------------------------------------------------------------------------------ round trip


def test_round_trip_bitwise(ckpt: Path) -> None:
    tensors, meta = read_checkpoint(ckpt)
    expected = _sample_tensors()
    assert sorted(tensors) == ["bytes", "model", "optimizer"]
    for stem in expected:
        _assert_bitwise_equal(tensors[stem], expected[stem])
    assert tensors["optimizer"]["step"].tolist() == [7, -(2**62), 2**62]
    assert tensors["bytes"]["u8"].dtype == torch.uint8
    assert tensors["bytes"]["u8"][15, 15].item() == 255
    assert _bits(tensors["model"]["w_t"]) == _bits(tensors["model"]["w"].t())
    assert meta == META
    assert read_file(ckpt, "config.json") == b'{"hidden": 8}'


def test_manifest_describes_every_file(ckpt: Path) -> None:
    manifest = verify_checkpoint(ckpt)
    assert manifest["format"] == "lockstep-checkpoint"
    assert manifest["version"] == 1
    on_disk = sorted(p.name for p in ckpt.iterdir())
    assert on_disk == sorted([*manifest["files"], "MANIFEST.json"])
    assert sorted(manifest["files"]) == [
        "bytes.safetensors", "config.json", "meta.json", "model.safetensors",
        "optimizer.safetensors",
    ]
    for name, entry in manifest["files"].items():
        data = (ckpt / name).read_bytes()
        assert entry == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    assert is_complete(ckpt)
    assert _hidden(ckpt.parent) == []


def test_read_selected_stems(ckpt: Path) -> None:
    tensors, meta = read_checkpoint(ckpt, stems=["optimizer"])
    assert list(tensors) == ["optimizer"]
    _assert_bitwise_equal(tensors["optimizer"], _sample_tensors()["optimizer"])
    assert meta["step"] == 100
    with pytest.raises(CheckpointError, match="nope"):
        read_checkpoint(ckpt, stems=["model", "nope"])
    with pytest.raises(TypeError):
        read_checkpoint(ckpt, stems="model")


def test_tied_weights_and_meta_only(tmp_path: Path) -> None:
    emb = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    p = write_checkpoint(tmp_path / "tied", tensors={"model": {"emb": emb, "head": emb}}, meta={})
    tensors, meta = read_checkpoint(p)
    assert torch.equal(tensors["model"]["emb"], emb) and torch.equal(tensors["model"]["head"], emb)
    assert meta == {}
    q = write_checkpoint(tmp_path / "meta-only", tensors={}, meta={"a": 1})
    assert read_checkpoint(q) == ({}, {"a": 1})


# ------------------------------------------------------------------------------ torn / tampered


def test_missing_manifest_is_refused(ckpt: Path) -> None:
    (ckpt / "MANIFEST.json").unlink()
    with pytest.raises(CheckpointError, match="missing MANIFEST.json") as exc:
        read_checkpoint(ckpt)
    assert str(ckpt) in str(exc.value)
    assert not is_complete(ckpt)


def test_truncated_tensor_file_is_refused(ckpt: Path) -> None:
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-5])
    with pytest.raises(CheckpointError, match=r"size mismatch for 'model.safetensors'"):
        read_checkpoint(ckpt, stems=["optimizer"])  # even when that stem is not requested
    assert not is_complete(ckpt)


def test_modified_tensor_file_is_refused(ckpt: Path) -> None:
    f = ckpt / "optimizer.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"sha256 mismatch for 'optimizer.safetensors'"):
        read_checkpoint(ckpt)


def test_missing_listed_file_is_refused(ckpt: Path) -> None:
    (ckpt / "bytes.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"missing file 'bytes.safetensors'"):
        read_checkpoint(ckpt)


def test_unlisted_tensor_file_is_refused(ckpt: Path) -> None:
    (ckpt / "stray.safetensors").write_bytes((ckpt / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match=r"unlisted tensor file.*stray.safetensors"):
        read_checkpoint(ckpt)
    assert not is_complete(ckpt)


def test_tampered_meta_and_extra_file_are_refused(ckpt: Path) -> None:
    (ckpt / "config.json").write_bytes(b'{"hidden": 9}')
    with pytest.raises(CheckpointError, match=r"config.json"):
        read_file(ckpt, "config.json")
    (ckpt / "config.json").write_bytes(b'{"hidden": 8}')
    assert read_file(ckpt, "config.json") == b'{"hidden": 8}'
    with pytest.raises(CheckpointError, match=r"'other.json' is not listed"):
        read_file(ckpt, "other.json")
    (ckpt / "meta.json").write_text(json.dumps({**META, "step": 101}, indent=2, sort_keys=True))
    with pytest.raises(CheckpointError, match=r"meta.json"):
        read_checkpoint(ckpt)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"{not json", "unreadable MANIFEST.json"),
        (b'{"format": "other", "version": 1, "files": {}}', "is not a 'lockstep-checkpoint'"),
        (b'{"format": "lockstep-checkpoint", "version": 2, "files": {}}', "unsupported manifest"),
        (b'{"format": "lockstep-checkpoint", "version": 1, "files": {}}', "listing meta.json"),
    ],
)
def test_bad_manifest_is_refused(ckpt: Path, content: bytes, message: str) -> None:
    (ckpt / "MANIFEST.json").write_bytes(content)
    with pytest.raises(CheckpointError, match=message):
        verify_checkpoint(ckpt)


def test_manifest_path_traversal_is_refused(ckpt: Path) -> None:
    manifest = json.loads((ckpt / "MANIFEST.json").read_bytes())
    manifest["files"]["../outside.json"] = {"sha256": "0" * 64, "bytes": 0}
    (ckpt / "MANIFEST.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=r"invalid manifest entry '../outside.json'"):
        verify_checkpoint(ckpt)


def test_missing_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        read_checkpoint(tmp_path / "nothing")
    assert not is_complete(tmp_path / "nothing")


# ------------------------------------------------------------------------------- write requests


@pytest.mark.parametrize("name", ["a/b", "..", "../x", "x..y", ".hidden", "MANIFEST.json",
                                  "meta.json", "w.safetensors", ""])
def test_bad_extra_file_names_are_rejected(tmp_path: Path, name: str) -> None:
    with pytest.raises(CheckpointError):
        write_checkpoint(tmp_path / "c", tensors={}, meta={}, files={name: b"x"})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("stem", ["a/b", "..", ".x", ""])
def test_bad_stems_are_rejected(tmp_path: Path, stem: str) -> None:
    with pytest.raises(CheckpointError, match="stem"):
        write_checkpoint(tmp_path / "c", tensors={stem: {"t": torch.zeros(1)}}, meta={})
    assert list(tmp_path.iterdir()) == []


def test_unserialisable_meta_is_rejected(tmp_path: Path) -> None:
    for meta in ({"x": object()}, {"x": float("nan")}):
        with pytest.raises(CheckpointError, match="JSON"):
            write_checkpoint(tmp_path / "c", tensors={}, meta=meta)
    with pytest.raises(CheckpointError, match="torch.Tensor"):
        write_checkpoint(tmp_path / "c", tensors={"m": {"t": [1, 2]}}, meta={})
    assert list(tmp_path.iterdir()) == []


# ------------------------------------------------------------------------------------- overwrite


def test_overwrite_false_refuses(ckpt: Path) -> None:
    before = {p.name: p.read_bytes() for p in ckpt.iterdir()}
    with pytest.raises(CheckpointError, match="already exists"):
        write_checkpoint(ckpt, tensors={"model": {"w": torch.ones(2)}}, meta={"step": 1})
    assert {p.name: p.read_bytes() for p in ckpt.iterdir()} == before
    assert read_checkpoint(ckpt)[1] == META
    assert _hidden(ckpt.parent) == []


@pytest.mark.parametrize("atomic_exchange", [True, False])
def test_overwrite_true_replaces(ckpt: Path, monkeypatch: pytest.MonkeyPatch,
                                 atomic_exchange: bool) -> None:
    if not atomic_exchange:
        monkeypatch.setattr(cio, "_exchange", lambda a, b: False)
    new = {"model": {"w": torch.full((2, 2), 5, dtype=torch.int64)}}
    p = write_checkpoint(ckpt, tensors=new, meta={"step": 200}, overwrite=True)
    assert p == ckpt
    tensors, meta = read_checkpoint(ckpt)
    assert meta == {"step": 200}
    _assert_bitwise_equal(tensors["model"], new["model"])
    assert sorted(x.name for x in ckpt.iterdir()) == ["MANIFEST.json", "meta.json",
                                                       "model.safetensors"]
    assert _hidden(ckpt.parent) == []


def test_exchange_swaps_directories_atomically(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    (a / "x").write_text("from a")
    (b / "y").write_text("from b")
    # Linux has renameat2(RENAME_EXCHANGE); elsewhere the two-rename fallback (tested above) is used.
    assert cio._exchange(a, b), "renameat2(RENAME_EXCHANGE) failed on this machine"
    assert (a / "y").read_text() == "from b" and (b / "x").read_text() == "from a"
    assert not (a / "x").exists() and not (b / "y").exists()


def test_overwrite_refuses_non_checkpoint_dir(tmp_path: Path) -> None:
    target = tmp_path / "precious"
    target.mkdir()
    (target / "notes.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="refusing to replace"):
        write_checkpoint(target, tensors={}, meta={}, overwrite=True)
    assert (target / "notes.txt").read_text() == "keep me"
    assert _hidden(tmp_path) == []


# ------------------------------------------------------------------------------------- crashes


def test_failed_rename_leaves_nothing_at_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                              ) -> None:
    def boom(src, dst):
        raise OSError("simulated crash during rename")

    monkeypatch.setattr(os, "rename", boom)
    with pytest.raises(OSError, match="simulated crash"):
        write_checkpoint(tmp_path / "c", tensors=_sample_tensors(), meta=META)
    assert not (tmp_path / "c").exists()
    assert list(tmp_path.iterdir()) == []  # the temp dir was cleaned up


def test_failed_exchange_keeps_previous(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(a, b):
        raise OSError("simulated crash during exchange")

    monkeypatch.setattr(cio, "_exchange", boom)
    with pytest.raises(OSError, match="simulated crash"):
        write_checkpoint(ckpt, tensors={"model": {"w": torch.ones(1)}}, meta={}, overwrite=True)
    tensors, meta = read_checkpoint(ckpt)
    assert meta == META
    _assert_bitwise_equal(tensors["model"], _sample_tensors()["model"])
    assert _hidden(ckpt.parent) == []


@pytest.mark.parametrize("fail_on_call", [1, 2])
def test_failed_fallback_rename_keeps_previous(ckpt: Path, monkeypatch: pytest.MonkeyPatch,
                                               fail_on_call: int) -> None:
    """Non-atomic replace: old aside (call 1), new in (call 2); either failing keeps the old."""
    real_rename, calls = os.rename, []

    def flaky(src, dst):
        calls.append((Path(src).name, Path(dst).name))
        if len(calls) == fail_on_call:
            raise OSError("simulated crash during rename")
        real_rename(src, dst)

    monkeypatch.setattr(cio, "_exchange", lambda a, b: False)
    monkeypatch.setattr(os, "rename", flaky)
    with pytest.raises(OSError, match="simulated crash"):
        write_checkpoint(ckpt, tensors={"model": {"w": torch.ones(1)}}, meta={}, overwrite=True)
    assert calls[0][0] == "step-100" and calls[0][1].startswith(".step-100.old-")
    assert read_checkpoint(ckpt)[1] == META
    assert _hidden(ckpt.parent) == []


_CHILD = textwrap.dedent(
    """
    import os, sys, torch
    from lockstep.engine import checkpoint_io as cio
    target, mode = sys.argv[1], sys.argv[2]
    real_rename, calls = os.rename, []
    def die(src, dst):
        calls.append(src)
        if mode == "fresh" or len(calls) == 2:
            os._exit(17)  # a hard crash: no except/finally blocks run
        real_rename(src, dst)
    if mode == "replace":
        cio._exchange = lambda a, b: False
    os.rename = die
    cio.write_checkpoint(target, tensors={"model": {"w": torch.ones(3)}}, meta={"new": True},
                         overwrite=True)
    """
)


def _crash_child(target: Path, mode: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(Path(cio.__file__).parents[2])}
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(target), mode], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 17, proc.stderr


def test_hard_crash_leaves_temp_dir_that_is_never_a_checkpoint(tmp_path: Path) -> None:
    target = tmp_path / "c"
    _crash_child(target, "fresh")
    assert not target.exists()
    (tmp,) = tmp_path.iterdir()
    assert tmp.name.startswith(".c.tmp-")
    assert (tmp / "MANIFEST.json").is_file()  # fully written, only the rename was missing
    assert not is_complete(tmp)
    with pytest.raises(CheckpointError, match="leftover temporary directory"):
        read_checkpoint(tmp)
    with pytest.raises(CheckpointError, match="does not exist"):
        read_checkpoint(target)
    (tmp_path / "unrelated").mkdir()
    assert clean_stale_temps(tmp_path) == [tmp]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["unrelated"]


def test_hard_crash_mid_replace_is_recovered(ckpt: Path) -> None:
    _crash_child(ckpt, "replace")
    assert not ckpt.exists()  # died between "old aside" and "new in"
    hidden = _hidden(ckpt.parent)
    assert len(hidden) == 2
    assert any(".step-100.old-" in h for h in hidden) and any(".step-100.tmp-" in h for h in hidden)
    touched = clean_stale_temps(ckpt.parent)
    assert sorted(p.name for p in touched) == hidden
    assert _hidden(ckpt.parent) == []
    tensors, meta = read_checkpoint(ckpt)  # the previous checkpoint is back in place
    assert meta == META
    _assert_bitwise_equal(tensors["model"], _sample_tensors()["model"])


def test_clean_stale_temps_deletes_old_copy_when_target_exists(ckpt: Path) -> None:
    old = ckpt.parent / f".step-100.old-{'a' * 32}"
    tmp = ckpt.parent / f".step-100.tmp-{'b' * 32}"
    for d in (old, tmp):
        d.mkdir()
        for f in ckpt.iterdir():
            (d / f.name).write_bytes(f.read_bytes())
    assert not is_complete(old) and not is_complete(tmp)
    assert clean_stale_temps(ckpt.parent) == [old, tmp]
    assert _hidden(ckpt.parent) == [] and is_complete(ckpt)


# ------------------------------------------------------------------------------------------- rng


def _draw() -> tuple[bytes, bytes, list[float]]:
    return (
        torch.rand(8).numpy().tobytes() + torch.randint(0, 2**31, (4,)).numpy().tobytes(),
        np.random.rand(8).tobytes() + np.random.standard_normal(3).tobytes(),
        [random.random() for _ in range(5)] + [random.gauss(0, 1)],
    )


def test_rng_state_round_trip(tmp_path: Path) -> None:
    torch.manual_seed(7)
    np.random.seed(7)
    random.seed(7)
    _draw()  # draws an odd number of gaussians, leaving one cached in numpy and in `random`
    captured = rng_state_tensors()
    assert captured["torch_cpu"].dtype == torch.uint8
    assert captured["numpy_key"].shape == (624,) and captured["python_state"].shape == (625,)
    assert captured["numpy_has_gauss"].item() == 1 and captured["python_has_gauss"].item() == 1
    first = _draw()
    p = write_checkpoint(tmp_path / "rng", tensors={"rng": captured}, meta={})
    _draw()  # move every generator on
    restore_rng_state(read_checkpoint(p)[0]["rng"])
    second = _draw()
    assert first[0] == second[0]
    assert first[1] == second[1]
    assert first[2] == second[2]
    assert first != _draw()


def test_restore_rng_state_rejects_bad_state() -> None:
    state = rng_state_tensors()
    before = torch.get_rng_state().clone()
    with pytest.raises(CheckpointError, match="missing"):
        restore_rng_state({k: v for k, v in state.items() if k != "numpy_key"})
    with pytest.raises(CheckpointError):
        restore_rng_state({**state, "python_state": torch.full((625,), -1, dtype=torch.int64)})
    with pytest.raises(CheckpointError):
        restore_rng_state({**state, "numpy_key": torch.zeros(3, dtype=torch.int64)})
    with pytest.raises(CheckpointError, match="exactly one value"):
        restore_rng_state({**state, "numpy_pos": torch.zeros(2, dtype=torch.int64)})
    with pytest.raises(CheckpointError, match="uint8"):
        restore_rng_state({**state, "torch_cpu": state["torch_cpu"].to(torch.int64)})
    with pytest.raises(CheckpointError, match="invalid"):
        restore_rng_state({**state, "torch_cpu": state["torch_cpu"][:10]})
    assert torch.equal(torch.get_rng_state(), before)  # nothing was half restored


# ------------------------------------------------------------------------------------- no pickle


def _is_safetensors(data: bytes) -> bool:
    """u64 header length, JSON header, then exactly the tensor bytes the header accounts for."""
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    return len(data) == 8 + n + max(ends, default=0)


def test_pickle_file_fails_the_format_check(tmp_path: Path) -> None:
    """The check above must actually reject a torch.save (zip+pickle) file."""
    torch.save({"w": torch.ones(2)}, tmp_path / "x.pt")
    data = (tmp_path / "x.pt").read_bytes()
    try:
        ok = _is_safetensors(data)
    except (ValueError, struct.error):
        ok = False
    assert not ok


def test_no_file_is_a_pickle(tmp_path: Path) -> None:
    p = write_checkpoint(tmp_path / "c", tensors={**_sample_tensors(), "rng": rng_state_tensors()},
                         meta=META, files={"adapter_config.json": b'{"r": 8}'})
    names = sorted(f.name for f in p.iterdir())
    assert names == ["MANIFEST.json", "adapter_config.json", "bytes.safetensors", "meta.json",
                     "model.safetensors", "optimizer.safetensors", "rng.safetensors"]
    for f in p.iterdir():  # each file parses fully as JSON or as safetensors, so none is a pickle
        data = f.read_bytes()
        if f.suffix == ".json":
            assert isinstance(json.loads(data), dict), f.name
        else:
            assert f.suffix == ".safetensors" and _is_safetensors(data), f.name
