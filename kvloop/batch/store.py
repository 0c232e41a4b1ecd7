"""Where batch files and metadata live.

    <directory>/files/<file id>            a file's bytes (mode 0600)
    <directory>/journals/<batch id>.jsonl  a batch's results so far (journal.py)
    <directory>/meta/{file,batch}/<id>.json  metadata, without Redis

`DirMeta` keeps metadata as JSON files (one router per directory); `RedisMeta` keeps it in
Redis (`kvloop:batch:` keys), so router replicas that share the directory share batches, and
a batch runs on the replica holding its claim (a key with a TTL the runner renews). Every
call is blocking: the service calls them off the event loop. Owner: `BatchService`.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import threading
from pathlib import Path
from typing import Any, Protocol

from kvloop.batch.shapes import TERMINAL

KINDS = ("file", "batch")
REDIS_PREFIX = "kvloop:batch:"


def write_atomic(path: Path, data: bytes) -> None:
    """`data` at `path`, whole or not at all (a crash leaves the old file or none)."""
    tmp = path.with_name(f"{path.name}.{secrets.token_hex(4)}.tmp")   # one per writer
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


class Blobs:
    """Files' bytes and batches' journals in the directory."""

    def __init__(self, directory: str):
        self.root = Path(directory)

    def _dir(self, name: str) -> Path:
        d = self.root / name
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        return d

    def path(self, fid: str) -> Path:
        return self._dir("files") / fid

    def journal(self, bid: str) -> Path:
        return self._dir("journals") / f"{bid}.jsonl"

    def put(self, fid: str, data: bytes) -> None:
        write_atomic(self.path(fid), data)

    def get(self, fid: str) -> bytes | None:
        try:
            return self.path(fid).read_bytes()
        except FileNotFoundError:
            return None

    def delete(self, fid: str) -> None:
        self.path(fid).unlink(missing_ok=True)


class Meta(Protocol):
    """Metadata of files and batches (each a dict with `id`, `created_at` and `_owner`)."""

    def put(self, kind: str, obj: dict[str, Any]) -> None: ...
    def get(self, kind: str, oid: str) -> dict[str, Any] | None: ...
    def delete(self, kind: str, oid: str) -> None: ...
    def owned(self, kind: str, owner: str) -> list[dict[str, Any]]:
        """The owner's objects, newest first."""
        ...
    def active(self) -> list[str]:
        """Ids of batches not in a terminal status."""
        ...
    def claim(self, bid: str, holder: str, ttl_s: float) -> bool:
        """Take or renew the right to run `bid` (False: another holder has it)."""
        ...
    def release(self, bid: str, holder: str) -> None: ...


def order_key(obj: dict[str, Any]) -> int:
    """When `obj` was made, in microseconds (`created_at` is whole seconds: two objects made
    in one second keep the order they were made in)."""
    return int(obj.get("_created_us") or obj["created_at"] * 1_000_000)


def _newest_first(objs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return sorted(objs, key=lambda o: (order_key(o), o["id"]), reverse=True)


class DirMeta:
    """Metadata as JSON files; a claim is an exclusive `flock` on `claims/<id>.lock`, held
    until released or the process ends (so processes on one host sharing the directory
    never run one batch twice)."""

    def __init__(self, directory: str):
        self.root = Path(directory) / "meta"
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def _path(self, kind: str, oid: str) -> Path:
        d = self.root / kind
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        return d / f"{oid}.json"

    def put(self, kind: str, obj: dict[str, Any]) -> None:
        write_atomic(self._path(kind, obj["id"]), json.dumps(obj).encode())

    def get(self, kind: str, oid: str) -> dict[str, Any] | None:
        try:
            return json.loads(self._path(kind, oid).read_bytes())   # type: ignore[no-any-return]
        except FileNotFoundError:
            return None

    def delete(self, kind: str, oid: str) -> None:
        self._path(kind, oid).unlink(missing_ok=True)

    def _all(self, kind: str) -> list[dict[str, Any]]:
        d = self.root / kind
        out = []
        for p in d.glob("*.json") if d.is_dir() else ():
            try:
                out.append(json.loads(p.read_bytes()))
            except (FileNotFoundError, ValueError):
                continue   # deleted meanwhile
        return out

    def owned(self, kind: str, owner: str) -> list[dict[str, Any]]:
        return _newest_first([o for o in self._all(kind) if o.get("_owner") == owner])

    def active(self) -> list[str]:
        return [o["id"] for o in self._all("batch") if o["status"] not in TERMINAL]

    def claim(self, bid: str, holder: str, ttl_s: float) -> bool:
        with self._lock:
            if bid in self._held:
                return True
            fd = os.open(self._path("claims", bid).with_suffix(".lock"),
                         os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                return False
            self._held[bid] = fd
            return True

    def release(self, bid: str, holder: str) -> None:
        with self._lock:
            fd = self._held.pop(bid, None)
        if fd is not None:
            os.close(fd)


class RedisMeta:
    """Metadata in Redis: `kvloop:batch:{kind}:{id}` (JSON), `...:{kind}s:{owner}` (a sorted
    set by creation time), `...:active` (a set), `...:claim:{id}` (holder, with a TTL)."""

    def __init__(self, url: str, password: str | None = None):
        import redis

        self.r = redis.Redis.from_url(url, password=password, socket_timeout=5.0,
                                      socket_connect_timeout=5.0)

    def put(self, kind: str, obj: dict[str, Any]) -> None:
        p = self.r.pipeline()
        p.set(f"{REDIS_PREFIX}{kind}:{obj['id']}", json.dumps(obj))
        p.zadd(f"{REDIS_PREFIX}{kind}s:{obj['_owner']}", {obj["id"]: order_key(obj)})
        if kind == "batch":
            if obj["status"] in TERMINAL:
                p.srem(REDIS_PREFIX + "active", obj["id"])
            else:
                p.sadd(REDIS_PREFIX + "active", obj["id"])
        p.execute()

    def get(self, kind: str, oid: str) -> dict[str, Any] | None:
        raw = self.r.get(f"{REDIS_PREFIX}{kind}:{oid}")
        return None if raw is None else json.loads(raw)   # type: ignore[arg-type]

    def delete(self, kind: str, oid: str) -> None:
        obj = self.get(kind, oid)
        if obj is not None:
            p = self.r.pipeline()
            p.delete(f"{REDIS_PREFIX}{kind}:{oid}")
            p.zrem(f"{REDIS_PREFIX}{kind}s:{obj['_owner']}", oid)
            p.srem(REDIS_PREFIX + "active", oid)
            p.execute()

    def owned(self, kind: str, owner: str) -> list[dict[str, Any]]:
        ids = self.r.zrange(f"{REDIS_PREFIX}{kind}s:{owner}", 0, -1)
        if not ids:
            return []
        raws = self.r.mget([f"{REDIS_PREFIX}{kind}:{i.decode()}" for i in ids])  # type: ignore
        return _newest_first([json.loads(r) for r in raws if r is not None])

    def active(self) -> list[str]:
        return sorted(i.decode() for i in self.r.smembers(REDIS_PREFIX + "active"))  # type: ignore

    def claim(self, bid: str, holder: str, ttl_s: float) -> bool:
        key, ms = f"{REDIS_PREFIX}claim:{bid}", int(ttl_s * 1000)
        if self.r.set(key, holder, nx=True, px=ms):
            return True
        if self.r.get(key) == holder.encode():
            self.r.pexpire(key, ms)
            return True
        return False

    def release(self, bid: str, holder: str) -> None:
        key = f"{REDIS_PREFIX}claim:{bid}"
        if self.r.get(key) == holder.encode():
            self.r.delete(key)


def make_meta(directory: str, redis_url: str | None, password: str | None) -> Meta:
    return RedisMeta(redis_url, password) if redis_url else DirMeta(directory)
