"""The tiers below the block pool: host memory, a local directory, a shared store.

Each tier maps a record key (`tier_record.record_key`) to one block's record bytes and is
safe to call from the engine thread (`contains`, lookups) and the offloading connector's I/O
thread (`get`, `put`) at once. A tier with a size evicts least recently used records (a
`get` or `put` makes a record the most recent) and says which keys it evicted, so the
connector can publish their `BlockRemoved`.

- `HostTier`: records in host memory (`MEDIUM_CPU`).
- `FileTier`: one file per record in a directory (`MEDIUM_STORAGE`): written to a temporary
  name and renamed, so a reader never sees half a file it would take for whole (a torn file
  is still caught by the record's MAC). Used for the local disk (`LOCAL`; its index is
  rebuilt from the directory at start, oldest file first, only when records are signed with
  the fleet secret: without one their MAC is a checksum anybody can compute, so the tier
  trusts only what this process wrote and removes this model's older files; the directory
  must be this user's and writable by nobody else, created 0700) and for a `file://` shared store
  (`REMOTE`: another worker's files count as held; nothing is scanned or deleted but this
  worker's own writes, evicted within its `shared_bytes`).
- `RedisTier`: a `redis://` shared store (`MEDIUM_STORAGE`, `REMOTE`); the server bounds its
  memory, each key lives `shared_ttl_s`.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Protocol, TypeVar
from urllib.parse import urlsplit

from kvloop.config import KV_STORE_PASSWORD_ENV, KVOffloadConfig
from kvloop.events.types import LOCALITY_LOCAL, LOCALITY_REMOTE, MEDIUM_CPU, MEDIUM_STORAGE

REDIS_KEY_PREFIX = "kvloop:kv:"
logger = logging.getLogger("kvloop.kv_offload")
T = TypeVar("T")


class Tier(Protocol):
    name: str               # "cpu", "disk", "shared" (logs and stats)
    medium: str             # the events' medium
    locality: str | None    # the events' locality (storage tiers)

    def contains(self, key: str) -> bool: ...

    def contains_many(self, keys: list[str]) -> list[bool]: ...   # one round trip (redis)

    def get(self, key: str) -> bytes | None: ...

    def head(self, key: str, n: int) -> bytes | None: ...   # the record's first `n` bytes

    def put(self, key: str, record: bytes) -> list[str]: ...   # returns the keys evicted

    def discard(self, key: str) -> None: ...                  # a record that failed a check

    def keys(self) -> list[str]: ...                          # held now, least recent first

    def clear(self) -> list[str]: ...      # drop a private tier's records (shared: none)

    def close(self) -> None: ...


class _LRUIndex:
    """key -> size under a byte budget, least recently used first (callers hold the lock)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.sizes: OrderedDict[str, int] = OrderedDict()
        self.used = 0

    def add(self, key: str, size: int) -> list[str]:
        """Record `key` (most recent); returns the keys to drop to fit the budget."""
        self.remove(key)
        self.sizes[key] = size
        self.used += size
        evicted = []
        while self.used > self.capacity and len(self.sizes) > 1:
            old, old_size = self.sizes.popitem(last=False)
            self.used -= old_size
            evicted.append(old)
        return evicted

    def remove(self, key: str) -> None:
        size = self.sizes.pop(key, None)
        if size is not None:
            self.used -= size


class HostTier:
    """Records in host memory, LRU within `capacity` bytes."""

    name = "cpu"
    medium = MEDIUM_CPU
    locality: str | None = None

    def __init__(self, capacity: int):
        self._lock = threading.Lock()
        self._index = _LRUIndex(capacity)
        self._data: dict[str, bytes] = {}

    def contains(self, key: str) -> bool:
        with self._lock:
            return key in self._data

    def contains_many(self, keys: list[str]) -> list[bool]:
        with self._lock:
            return [k in self._data for k in keys]

    def get(self, key: str) -> bytes | None:
        with self._lock:
            record = self._data.get(key)
            if record is not None:
                self._index.sizes.move_to_end(key)
            return record

    def head(self, key: str, n: int) -> bytes | None:
        with self._lock:
            record = self._data.get(key)
        return None if record is None else record[:n]

    def put(self, key: str, record: bytes) -> list[str]:
        with self._lock:
            if len(record) > self._index.capacity:
                return []
            self._data[key] = record
            evicted = self._index.add(key, len(record))
            for k in evicted:
                del self._data[k]
            return evicted

    def discard(self, key: str) -> None:
        with self._lock:
            self._index.remove(key)
            self._data.pop(key, None)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._index.sizes)

    def clear(self) -> list[str]:
        with self._lock:
            keys = list(self._index.sizes)
            self._index = _LRUIndex(self._index.capacity)
            self._data.clear()
        return keys

    def close(self) -> None:
        pass


class FileTier:
    """One file per record under `directory`, LRU within `capacity` bytes of this worker's
    files. `shared`: other writers' files count as held too (a `file://` shared store)."""

    medium = MEDIUM_STORAGE

    def __init__(self, directory: str, capacity: int, *, shared: bool, key_prefix: str,
                 max_record_bytes: int = 256 << 20, trust_existing: bool = True):
        """`trust_existing` (a private tier): index the records already in `directory`
        (False: remove this model's, they may be anybody's). ValueError: a private tier's
        directory is not this user's, or others can write to it."""
        self.name = "shared" if shared else "disk"
        self.max_record_bytes = max_record_bytes
        self.locality: str | None = LOCALITY_REMOTE if shared else LOCALITY_LOCAL
        self.directory = directory
        self.shared = shared
        if not os.path.isdir(directory):
            os.makedirs(directory, mode=0o700)
            os.chmod(directory, 0o700)      # whatever the umask
        if not shared:
            check_private_dir(directory)
        self._lock = threading.Lock()
        self._index = _LRUIndex(capacity)
        if not shared:
            self._scan(key_prefix, trust_existing)

    def _scan(self, key_prefix: str, trust: bool) -> None:
        """Index this model's files already there, oldest first (a restart finds its blocks;
        not `trust`ed: removed instead); temporary files of a writer that died are removed."""
        found = []
        for entry in os.scandir(self.directory):
            if not entry.is_file(follow_symlinks=False):
                continue
            if entry.name.endswith(".tmp") or (not trust and entry.name.startswith(key_prefix)):
                os.unlink(entry.path)
            elif entry.name.startswith(key_prefix):
                st = entry.stat()
                found.append((st.st_mtime, entry.name, st.st_size))
        for _, name, size in sorted(found):
            for old in self._index.add(name, size):
                self._unlink(old)

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, key)

    def contains(self, key: str) -> bool:
        with self._lock:
            if key in self._index.sizes:
                return True
        return self.shared and os.path.exists(self._path(key))

    def contains_many(self, keys: list[str]) -> list[bool]:
        return [self.contains(k) for k in keys]

    def get(self, key: str) -> bytes | None:
        """The record (None: absent, or over `max_record_bytes`: a file no writer made)."""
        record = self.head(key, self.max_record_bytes + 1)
        if record is None or len(record) > self.max_record_bytes:
            return None
        with self._lock:
            if key in self._index.sizes:
                self._index.sizes.move_to_end(key)
        return record

    def head(self, key: str, n: int) -> bytes | None:
        try:
            with open(self._path(key), "rb") as f:
                return f.read(n)
        except FileNotFoundError:
            with self._lock:
                self._index.remove(key)
            return None
        except OSError as e:      # unreadable: a miss
            logger.warning("KV %s tier: cannot read %s: %s", self.name, key[:24], e)
            return None

    def put(self, key: str, record: bytes) -> list[str]:
        if len(record) > self._index.capacity:
            return []
        tmp = self._path(f"{key}.{uuid.uuid4().hex}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(record)
            os.replace(tmp, self._path(key))
        except OSError as e:      # a full or failing disk: this block is not stored
            logger.warning("KV %s tier: cannot write %s: %s", self.name, key[:24], e)
            self._unlink(os.path.basename(tmp))
            return []
        with self._lock:
            evicted = self._index.add(key, len(record))
        for old in evicted:
            self._unlink(old)
        return evicted

    def _unlink(self, key: str) -> None:
        try:
            os.unlink(self._path(key))
        except FileNotFoundError:
            pass

    def discard(self, key: str) -> None:
        """Forget a bad record; in a shared directory the file stays (a worker with the
        wrong key must not delete the fleet's blocks)."""
        with self._lock:
            self._index.remove(key)
        if not self.shared:
            self._unlink(key)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._index.sizes)

    def clear(self) -> list[str]:
        """This worker's own files in a private directory (a shared one: nothing)."""
        if self.shared:
            return []
        with self._lock:
            keys = list(self._index.sizes)
            self._index = _LRUIndex(self._index.capacity)
        for key in keys:
            self._unlink(key)
        return keys

    def close(self) -> None:
        pass


class RedisTier:
    """Records as redis string values `kvloop:kv:<key>`, each living `ttl_s`. The server
    being unreachable is a miss, never an error the engine sees: a failed call (within
    `timeout_s`) is logged and the tier answers "not held" for `RETRY_S` without asking."""

    name = "shared"
    medium = MEDIUM_STORAGE
    locality: str | None = LOCALITY_REMOTE
    RETRY_S = 5.0

    def __init__(self, url: str, ttl_s: float, max_record_bytes: int, timeout_s: float = 1.0):
        import redis

        parts = urlsplit(url)
        db = int(parts.path.strip("/") or 0)
        self._ttl_ms = max(1, int(ttl_s * 1000))
        self._max = max_record_bytes
        self._errors: tuple[type[Exception], ...] = (redis.RedisError, OSError)
        self._down_until = 0.0
        self._client: Any = redis.Redis(
            host=parts.hostname or "", port=parts.port or 6379, db=db,
            password=os.environ.get(KV_STORE_PASSWORD_ENV) or None,
            socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._client.ping()    # a wrong address or password fails at start, not per block

    def _call(self, fn: Callable[[], T], default: T) -> T:
        if time.monotonic() < self._down_until:
            return default
        try:
            return fn()
        except self._errors as e:
            logger.warning("KV shared store unreachable (%s: %s); treating it as empty for "
                           "%.0f s", type(e).__name__, e, self.RETRY_S)
            self._down_until = time.monotonic() + self.RETRY_S
            return default

    def contains(self, key: str) -> bool:
        return self._call(lambda: bool(self._client.exists(REDIS_KEY_PREFIX + key)), False)

    def contains_many(self, keys: list[str]) -> list[bool]:
        def ask() -> list[bool]:
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(REDIS_KEY_PREFIX + k)
            return [bool(n) for n in pipe.execute()]

        return self._call(ask, [False] * len(keys)) if keys else []

    def get(self, key: str) -> bytes | None:
        return self._call(lambda: self._get(REDIS_KEY_PREFIX + key), None)

    def _get(self, name: str) -> bytes | None:
        if int(self._client.strlen(name)) > self._max:
            return None
        record = self._client.get(name)
        return bytes(record) if record is not None else None

    def head(self, key: str, n: int) -> bytes | None:
        record = self._call(lambda: self._client.getrange(REDIS_KEY_PREFIX + key, 0, n - 1),
                            None)
        return bytes(record) if record else None

    def put(self, key: str, record: bytes) -> list[str]:
        self._call(lambda: self._client.set(REDIS_KEY_PREFIX + key, record, px=self._ttl_ms),
                   None)
        return []

    def discard(self, key: str) -> None:
        """Nothing: a worker with the wrong key must not delete the fleet's blocks (a bad
        record expires with its TTL)."""

    def keys(self) -> list[str]:
        return []     # the fleet's store: nothing of it is this worker's to announce at start

    def clear(self) -> list[str]:
        return []     # the fleet's store: not this worker's to empty

    def close(self) -> None:
        self._client.close()


def check_private_dir(directory: str) -> None:
    """ValueError unless `directory` is a directory owned by this user that no other user
    can write to (another local user could plant records in it)."""
    st = os.stat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"KV disk tier: {directory} is not a directory")
    if st.st_uid != os.geteuid():
        raise ValueError(f"KV disk tier: {directory} belongs to uid {st.st_uid}, not to "
                         f"this user ({os.geteuid()}); use a directory of your own")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise ValueError(f"KV disk tier: {directory} is writable by other users (mode "
                         f"{stat.S_IMODE(st.st_mode):o}); chmod 700 it or use another")


def make_tiers(config: KVOffloadConfig, key_prefix: str, *,
               signed: bool = False) -> list[Tier]:
    """The configured tiers, fastest first; `signed`: records carry the fleet secret's MAC
    (a restarted disk tier may trust its files)."""
    tiers: list[Tier] = []
    if config.cpu_bytes:
        tiers.append(HostTier(config.cpu_bytes))
    if config.disk_path is not None:
        tiers.append(FileTier(config.disk_path, config.disk_bytes, shared=False,
                              key_prefix=key_prefix, max_record_bytes=config.max_block_bytes,
                              trust_existing=signed))
    url = config.shared_store
    if url is not None and url.startswith("file://"):
        tiers.append(FileTier(urlsplit(url).path, config.shared_bytes or (1 << 62),
                              shared=True, key_prefix=key_prefix,
                              max_record_bytes=config.max_block_bytes))
    elif url is not None:
        tiers.append(RedisTier(url, config.shared_ttl_s, config.max_block_bytes))
    return tiers
