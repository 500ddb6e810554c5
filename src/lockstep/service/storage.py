"""Durable storage for checkpoints, sampler weights and job artifacts, through fsspec.

A local directory by default; `s3://bucket/prefix` (or any fsspec URL) otherwise. Checkpoint
directories are written locally by the engine (atomically, with a sha256 manifest written last)
and then uploaded the same way: every file first, `MANIFEST.json` last, so that a reader which
trusts only directories with a manifest never sees a torn upload.
"""

from __future__ import annotations

import os
import posixpath
import shutil
import tempfile
import threading
import uuid
from collections import Counter, OrderedDict
from contextlib import contextmanager
from pathlib import Path

import fsspec

MANIFEST = "MANIFEST.json"


def unique_key(parent: str, leaf: str) -> str:
    """`parent/<new id>/leaf`, a key no save has used before: a save never replaces an object in
    place, so no cached copy of an older save can be served for a newer one under the same name."""
    return f"{parent}/{uuid.uuid4().hex[:12]}/{leaf}"


class Storage:
    def __init__(self, url: str, **options):
        self.url = url.rstrip("/")
        if self.url.startswith("s3://"):
            # The API and the workers write the same bucket from different processes: a cached
            # listing in one would hide the other's writes.
            options = {"use_listings_cache": False, "skip_instance_cache": True, **options}
        self.fs, root = fsspec.core.url_to_fs(self.url, **options)
        self.root = root.rstrip("/")
        self.local = self.fs.protocol in ("file", ("file", "local")) or "file" in self.fs.protocol
        if self.local:
            Path(self.root).mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> str:
        if ".." in key.split("/") or key.startswith("/"):
            raise ValueError(f"storage key {key!r} must be a relative path without '..'")
        return posixpath.join(self.root, key)

    # -- directories (checkpoints) -------------------------------------------------------------
    def put_dir(self, local: str | Path, key: str) -> int:
        """Upload a local checkpoint directory under `key`, manifest last; returns bytes uploaded."""
        local = Path(local)
        files = sorted(p for p in local.rglob("*") if p.is_file())
        if not any(p.name == MANIFEST for p in files):
            raise ValueError(f"{local} has no {MANIFEST}; only committed checkpoints are uploaded")
        target = self.path(key)
        if self.fs.exists(target):
            self.fs.rm(target, recursive=True)
        size = 0
        for p in sorted(files, key=lambda p: p.name == MANIFEST):  # the manifest goes last
            rel = p.relative_to(local).as_posix()
            self.fs.makedirs(posixpath.dirname(posixpath.join(target, rel)), exist_ok=True)
            self.fs.put_file(str(p), posixpath.join(target, rel))
            size += p.stat().st_size
        return size

    def has_dir(self, key: str) -> bool:
        return self.fs.exists(posixpath.join(self.path(key), MANIFEST))

    def get_dir(self, key: str, local: str | Path) -> Path:
        """Download a committed directory to `local` (which must not exist yet)."""
        if not self.has_dir(key):
            raise FileNotFoundError(f"no committed checkpoint at {self.url}/{key}")
        local = Path(local)
        local.mkdir(parents=True, exist_ok=False)
        src = self.path(key)
        for remote in self.fs.find(src):
            rel = posixpath.relpath(remote, src)
            dst = local / rel
            dst.parent.mkdir(parents=True, exist_ok=True)
            self.fs.get_file(remote, str(dst))
        return local

    def delete(self, key: str) -> None:
        target = self.path(key)
        if self.fs.exists(target):
            self.fs.rm(target, recursive=True)
        if self.local:  # and the directories the key alone used (object stores have none)
            for parent in Path(target).parents:
                if parent == Path(self.root) or not parent.is_relative_to(self.root):
                    break
                try:
                    parent.rmdir()
                except OSError:
                    break

    # -- files (artifacts) -----------------------------------------------------------------------
    def put_file(self, local: str | Path, key: str) -> None:
        target = self.path(key)
        self.fs.makedirs(posixpath.dirname(target), exist_ok=True)
        self.fs.put_file(str(local), target)

    def open(self, key: str, mode: str = "rb"):
        return self.fs.open(self.path(key), mode)

    def exists(self, key: str) -> bool:
        return self.fs.exists(self.path(key))

    def files(self, key: str) -> list[str]:
        """The files under a directory key, as paths relative to it, sorted."""
        root = self.path(key)
        return sorted(posixpath.relpath(f, root) for f in self.fs.find(root))

    def presign(self, key: str, expires_in_s: int) -> str | None:
        """The backend's own expiring URL for one object (S3's presigned GET), or None where the
        backend cannot sign (the local one: the API signs its own URL, service/signed_urls.py)."""
        if self.local:
            return None
        try:
            return self.fs.sign(self.path(key), expiration=expires_in_s)
        except NotImplementedError:
            return None

    def size(self, key: str) -> int:
        target = self.path(key)
        if self.fs.isdir(target):
            return sum(self.fs.size(f) for f in self.fs.find(target))
        return self.fs.size(target)


class FetchCache:
    """Local copies of committed storage directories, at most `max_bytes` of them (the one being
    read may exceed it on its own), the least recently used evicted first; a copy in use (inside
    `fetch`) is never evicted. Keys are unique per save (`unique_key`), so a cached copy is never
    stale. Written by hand: fsspec's caching filesystems cache single files with no size bound.
    """

    def __init__(self, storage: Storage, root: str | Path, max_bytes: int):
        self.storage, self.root, self.max_bytes = storage, Path(root), max_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._in_use: Counter = Counter()
        self._sizes: OrderedDict[str, int] = OrderedDict(self._scan())
        """key -> bytes, least recently used first."""

    def _scan(self) -> list[tuple[str, int]]:
        """Copies left by a previous process, least recently used first (`fetch` touches the
        manifest); its unfinished downloads are removed."""
        for tmp in self.root.glob(".fetch-*"):
            shutil.rmtree(tmp, ignore_errors=True)
        found = []
        for manifest in self.root.rglob(MANIFEST):
            d = manifest.parent
            if any(part.startswith(".") for part in d.relative_to(self.root).parts):
                continue  # an unfinished download
            found.append((manifest.stat().st_mtime, d.relative_to(self.root).as_posix(), _du(d)))
        return [(key, size) for _, key, size in sorted(found)]

    @property
    def bytes(self) -> int:
        return sum(self._sizes.values())

    def keys(self) -> list[str]:
        return list(self._sizes)

    @contextmanager
    def fetch(self, key: str):
        """A local copy of `key`, held for the `with` block. Downloads are serialised (the lock is
        held through one), so two readers never race on one copy."""
        with self._lock:
            if key in self._sizes:
                self._sizes.move_to_end(key)
                os.utime(self.root / key / MANIFEST)
            else:
                self._sizes[key] = _du(self._download(key))
            self._in_use[key] += 1
            self._evict()
        try:
            yield self.root / key
        finally:
            with self._lock:
                self._in_use[key] -= 1
                if not self._in_use[key]:
                    del self._in_use[key]
                self._evict()

    def _download(self, key: str) -> Path:
        dst = self.root / key
        if not dst.resolve().is_relative_to(self.root.resolve()):
            raise ValueError(f"storage key {key!r} leaves the cache directory")
        tmp = Path(tempfile.mkdtemp(dir=self.root, prefix=".fetch-"))
        try:
            tmp.rmdir()
            self.storage.get_dir(key, tmp)
            dst.parent.mkdir(parents=True, exist_ok=True)
            if dst.exists():  # a copy this process lost track of
                shutil.rmtree(dst)
            tmp.rename(dst)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return dst

    def _evict(self) -> None:
        total = self.bytes
        for key in list(self._sizes):
            if total <= self.max_bytes:
                break
            if self._in_use[key]:
                continue
            total -= self._sizes.pop(key)
            shutil.rmtree(self.root / key, ignore_errors=True)
            self._prune(self.root / key)

    def _prune(self, path: Path) -> None:
        """Remove the key's now-empty parent directories, up to the root."""
        for parent in path.parents:
            if parent == self.root or not parent.is_relative_to(self.root):
                break
            try:
                parent.rmdir()
            except OSError:
                break


def _du(path: Path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)
