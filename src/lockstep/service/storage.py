"""Durable storage for checkpoints, sampler weights and job artifacts, through fsspec.

A local directory by default; `s3://bucket/prefix` (or any fsspec URL) otherwise. Checkpoint
directories are written locally by the engine (atomically, with a sha256 manifest written last)
and then uploaded the same way: every file first, `MANIFEST.json` last, so that a reader which
trusts only directories with a manifest never sees a torn upload.
"""

from __future__ import annotations

import posixpath
import shutil
import tempfile
from pathlib import Path

import fsspec

MANIFEST = "MANIFEST.json"


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

    def fetch_dir(self, key: str, cache: str | Path) -> Path:
        """A local copy of a committed directory, cached under `cache` by key."""
        cache = Path(cache)
        dst = cache / key
        if (dst / MANIFEST).is_file():
            return dst
        cache.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=cache, prefix=".fetch-"))
        tmp.rmdir()
        self.get_dir(key, tmp)
        dst.parent.mkdir(parents=True, exist_ok=True)
        if dst.exists():
            shutil.rmtree(dst)
        tmp.rename(dst)
        return dst

    def delete(self, key: str) -> None:
        target = self.path(key)
        if self.fs.exists(target):
            self.fs.rm(target, recursive=True)

    # -- files (artifacts) -----------------------------------------------------------------------
    def put_file(self, local: str | Path, key: str) -> None:
        target = self.path(key)
        self.fs.makedirs(posixpath.dirname(target), exist_ok=True)
        self.fs.put_file(str(local), target)

    def open(self, key: str, mode: str = "rb"):
        return self.fs.open(self.path(key), mode)

    def exists(self, key: str) -> bool:
        return self.fs.exists(self.path(key))

    def size(self, key: str) -> int:
        target = self.path(key)
        if self.fs.isdir(target):
            return sum(self.fs.size(f) for f in self.fs.find(target))
        return self.fs.size(target)
