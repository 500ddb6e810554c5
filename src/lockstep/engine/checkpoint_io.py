"""Atomic, verifiable checkpoint directories (safetensors + JSON only, never pickle).

A checkpoint is a directory holding `<stem>.safetensors` tensor files, `meta.json`, optional extra
plain files, and `MANIFEST.json` listing the sha256 and size of every other file. The manifest is
written last inside a hidden sibling temp directory which is then renamed into place, so a reader
either sees a complete, hash-checked checkpoint or refuses it: a crash can never leave a torn
checkpoint at the target path, and nothing is loaded before the manifest has been verified.

Layout on disk, for a checkpoint at `runs/step-100`:
    runs/step-100/{MANIFEST.json, meta.json, model.safetensors, ...}   complete checkpoint
    runs/.step-100.tmp-<32 hex>/                                        unfinished write / old copy
    runs/.step-100.old-<32 hex>/                                        old copy during a replace
The hidden names are never accepted as checkpoints; `clean_stale_temps` removes them.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import json
import os
import random
import re
import shutil
import stat
import sys
import uuid
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

FORMAT = "lockstep-checkpoint"
VERSION = 1
MANIFEST = "MANIFEST.json"
META = "meta.json"
TENSOR_SUFFIX = ".safetensors"
_RESERVED = frozenset({MANIFEST, META})
_STALE_RE = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-[0-9a-f]{32}$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete or tampered with, or a write request is invalid."""


# --------------------------------------------------------------------------------------- helpers


def _err(path: Path, what: str) -> CheckpointError:
    """One message shape everywhere, so a log line always says which checkpoint and what broke."""
    return CheckpointError(f"checkpoint {str(path)!r}: {what}")


def _check_name(path: Path, name: object, what: str) -> str:
    """Keep every file a plain entry of the checkpoint dir: no traversal, no hidden or odd names."""
    bad = (
        not isinstance(name, str)
        or not name
        or name.startswith(".")
        or ".." in name
        or any(c in name for c in "/\\\0")
    )
    if bad:
        raise _err(path, f"invalid {what} {name!r}: must be a plain file name "
                         "(no slashes, no '..', not hidden)")
    return name


def _is_stale_name(name: str) -> bool:
    """Temp/aside dirs may hold a full manifest, so they are recognised by name, not by content."""
    return _STALE_RE.match(name) is not None


def _fsync_dir(path: Path) -> None:
    """Make a rename or a new directory entry durable; a file fsync alone does not cover it."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _hash_and_sync(file: Path) -> dict:
    """Hash what is actually on disk and fsync it, so the manifest describes durable bytes."""
    h, size = hashlib.sha256(), 0
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
        os.fsync(f.fileno())
    return {"sha256": h.hexdigest(), "bytes": size}


def _write_bytes(file: Path, data: bytes) -> dict:
    """Write, fsync and describe one small file (meta, extra files, manifest)."""
    with open(file, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def _sha256_file(file: Path) -> str:
    """Stream the hash so multi-GB tensor files are never held in memory."""
    h = hashlib.sha256()
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


@functools.cache
def _renameat2():
    """libc renameat2, if this platform has it; used for an atomic directory swap."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two directories (Linux RENAME_EXCHANGE); False if unsupported here.

    This is what makes overwrite truly atomic: there is no instant where `b` is absent.
    """
    fn = _renameat2()
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


# ----------------------------------------------------------------------------------------- write


def _prepare(path: Path, tensors: Mapping[str, Mapping[str, torch.Tensor]]
             ) -> dict[str, dict[str, torch.Tensor]]:
    """Detached, contiguous CPU copies; tensors sharing storage (tied weights) are cloned because
    safetensors refuses aliased tensors."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for stem, group in tensors.items():
        _check_name(path, stem, "tensor file stem")
        if not isinstance(group, Mapping):
            raise _err(path, f"tensors[{stem!r}] must be a dict of name -> tensor")
        flat: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for key, t in group.items():
            if not isinstance(key, str) or not isinstance(t, torch.Tensor):
                raise _err(path, f"tensors[{stem!r}][{key!r}] must map a str to a torch.Tensor")
            t = t.detach().to("cpu").contiguous()
            ptr = t.untyped_storage().data_ptr()
            if t.numel() and ptr in seen:
                t = t.clone()
            seen.add(ptr)
            flat[key] = t
        out[stem] = flat
    return out


def _check_files(path: Path, files: Mapping[str, bytes]) -> None:
    """Extra files must not collide with the manifest, meta.json or a tensor file."""
    for name, data in files.items():
        _check_name(path, name, "extra file name")
        if name in _RESERVED or name.endswith(TENSOR_SUFFIX):
            raise _err(path, f"extra file name {name!r} is reserved (MANIFEST.json, meta.json and "
                             f"*{TENSOR_SUFFIX} belong to the checkpoint format)")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise _err(path, f"extra file {name!r} must be bytes, got {type(data).__name__}")


def _encode_meta(path: Path, meta: dict) -> bytes:
    """Strict JSON (no NaN/Infinity) so any JSON reader can parse meta.json."""
    try:
        return json.dumps(meta, indent=2, sort_keys=True, allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise _err(path, f"meta is not JSON-serialisable: {e}") from e


def _fill(tmp: Path, tensors: dict[str, dict[str, torch.Tensor]], meta_bytes: bytes,
          files: Mapping[str, bytes]) -> None:
    """Write every file into the temp dir, manifest last, and make all of it durable."""
    listed: dict[str, dict] = {}
    for stem, group in tensors.items():
        file = tmp / f"{stem}{TENSOR_SUFFIX}"
        try:
            save_file(group, str(file))
        except (ValueError, TypeError, RuntimeError) as e:
            raise _err(tmp, f"cannot save tensors[{stem!r}] as safetensors: {e}") from e
        listed[file.name] = _hash_and_sync(file)
    listed[META] = _write_bytes(tmp / META, meta_bytes)
    for name, data in files.items():
        listed[name] = _write_bytes(tmp / name, bytes(data))
    manifest = {"format": FORMAT, "version": VERSION, "files": dict(sorted(listed.items()))}
    _write_bytes(tmp / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True).encode())
    _fsync_dir(tmp)


def _looks_like_checkpoint(path: Path) -> bool:
    """Guard for overwrite: only ever delete a directory that this module wrote."""
    try:
        return json.loads((path / MANIFEST).read_bytes()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _swap_in(tmp: Path, path: Path) -> None:
    """Replace an existing checkpoint so that `path` always holds a complete one.

    Prefer an atomic exchange; otherwise rename the old dir aside, rename the new one in, and put
    the old one back if that fails. A crash between the two renames leaves the old checkpoint in
    `.<name>.old-<hex>`, which `clean_stale_temps` renames back.
    """
    if _exchange(tmp, path):
        old = tmp
    else:
        old = path.parent / f".{path.name}.old-{uuid.uuid4().hex}"
        os.rename(path, old)
        try:
            os.rename(tmp, path)
        except BaseException:
            os.rename(old, path)
            raise
    _fsync_dir(path.parent)
    shutil.rmtree(old, ignore_errors=True)


def write_checkpoint(
    path: str | os.PathLike[str],
    *,
    tensors: Mapping[str, Mapping[str, torch.Tensor]],
    meta: dict,
    overwrite: bool = False,
    files: Mapping[str, bytes] | None = None,
) -> Path:
    """Atomically write a checkpoint directory and return its absolute path.

    `tensors` maps a file stem ("model", "optimizer", "rng") to a flat dict of tensors stored as
    `<stem>.safetensors`; `meta` goes to `meta.json` (it round-trips through JSON, so tuples come
    back as lists and non-str keys as str); `files` are extra plain files. Everything is written to
    a hidden sibling temp dir, fsynced, sealed with MANIFEST.json and renamed into place.
    """
    path = Path(os.path.abspath(path))
    if not path.name or _is_stale_name(path.name) or path.name.startswith("."):
        raise _err(path, "checkpoint directory name must be a visible, non-temporary name")
    files = dict(files or {})
    prepared = _prepare(path, tensors)
    _check_files(path, files)
    meta_bytes = _encode_meta(path, meta)
    _check_target(path, overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = staging_directory(path)
    try:
        _fill(tmp, prepared, meta_bytes, files)
        _move_into_place(tmp, path, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _move_into_place(tmp: Path, path: Path, overwrite: bool) -> None:
    _check_target(path, overwrite)
    if os.path.lexists(path):
        _swap_in(tmp, path)
    else:
        os.rename(tmp, path)
        _fsync_dir(path.parent)


def staging_directory(path: str | os.PathLike[str]) -> Path:
    """A fresh hidden sibling temp dir for `path`, to fill and then hand to commit_directory."""
    path = Path(os.path.abspath(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex}"
    tmp.mkdir()
    return tmp


def commit_directory(tmp: str | os.PathLike[str], path: str | os.PathLike[str], *, meta: dict,
                     overwrite: bool = False) -> Path:
    """Seal a staged directory that other code filled (e.g. transformers' save_pretrained).

    Every file is hashed into MANIFEST.json, written last after meta.json, and the directory is
    renamed into place as write_checkpoint does; on any failure the staged directory is removed.
    """
    tmp, path = Path(tmp), Path(os.path.abspath(path))
    try:
        listed: dict[str, dict] = {}
        for file in sorted(tmp.iterdir()):
            if not file.is_file() or file.is_symlink():
                raise _err(path, f"staged entry {file.name!r} is not a plain file; only flat directories are sealed")
            _check_name(path, file.name, "file name")
            listed[file.name] = _hash_and_sync(file)
        listed[META] = _write_bytes(tmp / META, _encode_meta(path, meta))
        manifest = {"format": FORMAT, "version": VERSION, "files": dict(sorted(listed.items()))}
        _write_bytes(tmp / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True).encode())
        _fsync_dir(tmp)
        _move_into_place(tmp, path, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _check_target(path: Path, overwrite: bool) -> None:
    """Refuse to clobber anything unless asked, and never anything that is not a checkpoint."""
    if not os.path.lexists(path):
        return
    if not overwrite:
        raise _err(path, "already exists (pass overwrite=True to replace it)")
    if path.is_symlink() or not path.is_dir():
        raise _err(path, "exists and is not a directory; refusing to replace it")
    if not _looks_like_checkpoint(path):
        raise _err(path, f"exists but has no lockstep {MANIFEST}; refusing to replace a directory "
                         "this module did not write")


# ------------------------------------------------------------------------------------------ read


def _load_manifest(path: Path) -> dict:
    """Parse MANIFEST.json and check its shape before trusting any name in it."""
    if not path.is_dir():
        raise _err(path, "does not exist or is not a directory")
    try:
        manifest = json.loads((path / MANIFEST).read_bytes())
    except FileNotFoundError:
        raise _err(path, f"missing {MANIFEST} (incomplete or torn checkpoint)") from None
    except (OSError, ValueError) as e:
        raise _err(path, f"unreadable {MANIFEST}: {e}") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise _err(path, f"{MANIFEST} is not a {FORMAT!r} manifest")
    if manifest.get("version") != VERSION:
        raise _err(path, f"unsupported manifest version {manifest.get('version')!r} "
                         f"(expected {VERSION})")
    if not isinstance(manifest.get("files"), dict) or META not in manifest["files"]:
        raise _err(path, f"{MANIFEST} has no 'files' table listing {META}")
    return manifest


def _verify_entry(path: Path, name: str, entry: object) -> None:
    """One listed file: a regular file (not a symlink) with the recorded size and sha256."""
    _check_name(path, name, "manifest entry")
    if name == MANIFEST:
        raise _err(path, f"{MANIFEST} lists itself")
    if (not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int)
            or not isinstance(entry.get("sha256"), str) or not _SHA256_RE.match(entry["sha256"])):
        raise _err(path, f"malformed manifest entry for {name!r}")
    file = path / name
    try:
        st = os.lstat(file)
    except FileNotFoundError:
        raise _err(path, f"missing file {name!r} listed in {MANIFEST}") from None
    if not stat.S_ISREG(st.st_mode):
        raise _err(path, f"{name!r} is not a regular file")
    if st.st_size != entry["bytes"]:
        raise _err(path, f"size mismatch for {name!r}: {st.st_size} bytes on disk, "
                         f"{entry['bytes']} in {MANIFEST} (truncated or modified)")
    if _sha256_file(file) != entry["sha256"]:
        raise _err(path, f"sha256 mismatch for {name!r} (file modified or corrupted)")


def verify_checkpoint(path: str | os.PathLike[str]) -> dict:
    """Check the whole checkpoint against its manifest and return the manifest.

    Also rejects `*.safetensors` files the manifest does not list, so a stray tensor file can never
    be mixed into a load.
    """
    path = Path(os.path.abspath(path))
    if _is_stale_name(path.name):
        raise _err(path, "is a leftover temporary directory from an unfinished write, not a "
                         "checkpoint")
    return _verify_contents(path)


def _verify_contents(path: Path) -> dict:
    """Everything verify_checkpoint checks except the directory's own name."""
    try:
        manifest = _load_manifest(path)
        for name, entry in manifest["files"].items():
            _verify_entry(path, name, entry)
        extra = sorted(p.name for p in path.iterdir()
                       if p.name.endswith(TENSOR_SUFFIX) and p.name not in manifest["files"])
    except OSError as e:
        raise _err(path, f"I/O error while verifying: {e}") from e
    if extra:
        raise _err(path, f"unlisted tensor file(s) not in {MANIFEST}: {', '.join(extra)}")
    return manifest


def is_complete(path: str | os.PathLike[str]) -> bool:
    """True only for a fully verified checkpoint (temp dirs and torn dirs are False)."""
    try:
        verify_checkpoint(path)
    except CheckpointError:
        return False
    return True


def _select_stems(path: Path, manifest: dict, stems: Iterable[str] | None) -> list[str]:
    """Only stems the (verified) manifest lists can be loaded; an unknown one is an error."""
    available = sorted(n[: -len(TENSOR_SUFFIX)] for n in manifest["files"]
                       if n.endswith(TENSOR_SUFFIX))
    if stems is None:
        return available
    if isinstance(stems, str):
        raise TypeError("stems must be an iterable of stem names, not a single str")
    wanted = list(stems)
    missing = [s for s in wanted if s not in available]
    if missing:
        raise _err(path, f"no tensor file for stem(s) {missing}; available: {available}")
    return wanted


def read_checkpoint(
    path: str | os.PathLike[str], *, stems: Iterable[str] | None = None
) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    """Verify the checkpoint, then load the requested stems (default: all) and meta.json.

    Verification comes first so nothing from a torn or tampered checkpoint is ever returned.
    """
    path = Path(os.path.abspath(path))
    manifest = verify_checkpoint(path)
    out: dict[str, dict[str, torch.Tensor]] = {}
    for stem in _select_stems(path, manifest, stems):
        name = f"{stem}{TENSOR_SUFFIX}"
        try:
            out[stem] = load_file(str(path / name))
        except Exception as e:  # safetensors raises its own SafetensorError type
            raise _err(path, f"cannot load {name!r}: {e}") from e
    try:
        meta = json.loads((path / META).read_bytes())
    except (OSError, ValueError) as e:
        raise _err(path, f"unreadable {META}: {e}") from e
    return out, meta


def read_file(path: str | os.PathLike[str], name: str) -> bytes:
    """Return one listed file's bytes after verifying the checkpoint and re-hashing those bytes."""
    path = Path(os.path.abspath(path))
    manifest = verify_checkpoint(path)
    _check_name(path, name, "file name")
    entry = manifest["files"].get(name)
    if entry is None:
        raise _err(path, f"file {name!r} is not listed in {MANIFEST}")
    data = (path / name).read_bytes()
    if hashlib.sha256(data).hexdigest() != entry["sha256"]:
        raise _err(path, f"sha256 mismatch for {name!r} (changed after verification)")
    return data


def clean_stale_temps(parent: str | os.PathLike[str]) -> list[Path]:
    """Remove `.<name>.tmp-<hex>` dirs left by crashed writes; return what was removed or restored.

    A `.<name>.old-<hex>` dir is the previous checkpoint set aside during a non-atomic replace: if
    `<name>` is missing and that copy verifies, it is renamed back instead of deleted. Do not call
    this while another process is writing a checkpoint into `parent`.
    """
    parent = Path(parent)
    touched: list[Path] = []
    for entry in sorted(parent.iterdir()):
        m = _STALE_RE.match(entry.name)
        if m is None or entry.is_symlink() or not entry.is_dir():
            continue
        target = parent / m["name"]
        if m["kind"] == "old" and _verifies_as(entry, target):
            os.rename(entry, target)
            _fsync_dir(parent)
        else:
            shutil.rmtree(entry)
        touched.append(entry)
    return touched


def _verifies_as(stale: Path, target: Path) -> bool:
    """Whether a set-aside dir is a complete checkpoint worth renaming back to `target`."""
    try:
        _verify_contents(stale)
    except CheckpointError:
        return False
    return not os.path.lexists(target)


# ------------------------------------------------------------------------------------------- rng

_RNG_SCALARS = ("numpy_pos", "numpy_has_gauss", "numpy_cached_gaussian", "python_version",
                "python_has_gauss", "python_gauss_next")
_RNG_KEYS = ("torch_cpu", "numpy_key", "python_state", *_RNG_SCALARS)


def rng_state_tensors() -> dict[str, torch.Tensor]:
    """Capture torch CPU, numpy global and Python `random` RNG state as plain tensors.

    Stored as tensors so the "rng" stem goes through safetensors like everything else (no pickle).
    Integers are int64 (MT19937 words are < 2**32) and the cached gaussians float64, so the
    encoding is exact. CUDA generators are not included.
    """
    kind, key, pos, has_gauss, cached = np.random.get_state(legacy=True)
    if kind != "MT19937":
        raise CheckpointError(f"numpy global RNG is {kind!r}; only MT19937 is supported")
    version, state, gauss_next = random.getstate()
    return {
        "torch_cpu": torch.get_rng_state().clone(),
        "numpy_key": torch.from_numpy(np.asarray(key, dtype=np.int64).copy()),
        "numpy_pos": torch.tensor([pos], dtype=torch.int64),
        "numpy_has_gauss": torch.tensor([has_gauss], dtype=torch.int64),
        "numpy_cached_gaussian": torch.tensor([cached], dtype=torch.float64),
        "python_version": torch.tensor([version], dtype=torch.int64),
        "python_state": torch.tensor(state, dtype=torch.int64),
        "python_has_gauss": torch.tensor([gauss_next is not None], dtype=torch.int64),
        "python_gauss_next": torch.tensor([gauss_next or 0.0], dtype=torch.float64),
    }


def _rng_words(t: torch.Tensor, name: str, size: int) -> np.ndarray:
    """Decode an int64 tensor of MT19937 words, refusing a wrong length or non-uint32 values."""
    a = t.detach().cpu().numpy().astype(np.int64).reshape(-1)
    if a.size != size or a.min() < 0 or a.max() >= 2**32:
        raise CheckpointError(f"rng state {name!r} is not a vector of {size} uint32 words")
    return a


def _decode_rng(tensors: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, tuple, tuple]:
    """Turn the tensors back into (torch state, numpy state tuple, `random` state tuple)."""
    missing = [k for k in _RNG_KEYS if k not in tensors]
    if missing:
        raise CheckpointError(f"rng state is missing {missing}")
    torch_state = tensors["torch_cpu"].detach().cpu()
    if torch_state.dtype != torch.uint8 or torch_state.dim() != 1:
        raise CheckpointError("rng state 'torch_cpu' must be a 1-d uint8 tensor")
    scalar = {k: tensors[k].reshape(-1) for k in _RNG_SCALARS}
    if any(v.numel() != 1 for v in scalar.values()):
        raise CheckpointError("rng state scalars must hold exactly one value each")
    key = _rng_words(tensors["numpy_key"], "numpy_key", 624).astype(np.uint32)
    np_state = ("MT19937", key, int(scalar["numpy_pos"].item()),
                int(scalar["numpy_has_gauss"].item()),
                float(scalar["numpy_cached_gaussian"].item()))
    words = tuple(int(x) for x in _rng_words(tensors["python_state"], "python_state", 625))
    gauss = (float(scalar["python_gauss_next"].item())
             if int(scalar["python_has_gauss"].item()) else None)
    return torch_state, np_state, (int(scalar["python_version"].item()), words, gauss)


def restore_rng_state(tensors: Mapping[str, torch.Tensor]) -> None:
    """Restore exactly what `rng_state_tensors` captured (torch CPU, numpy global, `random`).

    Everything is decoded and tried on throwaway generators before the global ones are touched,
    so a malformed state raises CheckpointError without leaving the RNGs half restored.
    """
    torch_state, np_state, py_state = _decode_rng(tensors)
    try:
        np.random.RandomState().set_state(np_state)
        random.Random().setstate(py_state)
        torch.Generator().set_state(torch_state)
    except (ValueError, TypeError, RuntimeError, IndexError, OverflowError) as e:
        raise CheckpointError(f"rng state is invalid: {e}") from e
    torch.set_rng_state(torch_state)
    np.random.set_state(np_state)
    random.setstate(py_state)
