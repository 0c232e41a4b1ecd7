"""The block pool: KV blocks, their ref counts, the free LRU queue, the hash map, KV events.

Owner: only the block pool changes a block's ref count, hash or free-queue links.

- Block 0 is the null block (never handed out, never freed), so `num_gpu_blocks - 1` blocks
  are usable, as in vLLM.
- Free blocks sit in an intrusive doubly linked queue (O(1) removal of a cache hit from the
  middle). Allocation and eviction take from the *front*. Freed blocks without a hash go to
  the front (reused first); freed hashed blocks go to the *tail*, so the least recently freed
  cached block is evicted first.
- A cached block stays in the hash map while it sits in the free queue (lazy eviction): it is
  un-hashed only when reallocated, which emits `BlockRemoved`. Caching a full block emits
  `BlockStored`; a successful reset emits `AllBlocksCleared`. `touch` and `free` emit nothing.
- Identical content in two physical blocks is not de-duplicated: the map keeps both.
- KV-cache groups (`kvloop.core.kv_cache_groups`): a block belongs to the group whose
  request table holds it; a cached block is found by (hash, group) (`group_key`: group 0's
  key is the bare hash, as before groups) and its events carry its group's `group_idx`,
  `kv_cache_spec_kind` and window.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from kvloop.core.hashing import event_extra_keys
from kvloop.core.kv_cache_groups import FULL_ATTENTION, KVCacheGroupSpec
from kvloop.events.types import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    event_int,
)


class KVCacheBlock:
    """One physical block. Fields are changed by the block pool only."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "group_id", "prev_free", "next_free",
                 "is_null")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.group_id = 0                  # the KV-cache group it is cached for
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        h = self.block_hash.hex()[:8] if self.block_hash else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hash={h})"


class FreeBlockQueue:
    """Intrusive doubly linked list of free blocks, with sentinel head and tail."""

    def __init__(self, blocks: Sequence[KVCacheBlock]):
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for b in blocks:
            prev.next_free = b
            b.prev_free = prev
            prev = b
        prev.next_free = self._tail
        self._tail.prev_free = prev

    def popleft(self) -> KVCacheBlock:
        first = self._head.next_free
        if first is None or first is self._tail:
            raise ValueError("No free blocks available")
        self.remove(first)
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Pop `n` blocks from the front, in order."""
        if n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} blocks, only {self.num_free_blocks} free")
        out: list[KVCacheBlock] = []
        cur = self._head.next_free
        for _ in range(n):
            assert cur is not None
            out.append(cur)
            nxt = cur.next_free
            cur.prev_free = cur.next_free = None
            cur = nxt
        self._head.next_free = cur
        assert cur is not None
        cur.prev_free = self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Append blocks, in order, at the tail."""
        last = self._tail.prev_free
        assert last is not None
        for b in blocks:
            last.next_free = b
            b.prev_free = last
            last = b
        last.next_free = self._tail
        self._tail.prev_free = last
        self.num_free_blocks += len(blocks)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Insert blocks, in order, at the front."""
        if not blocks:
            return
        first = self._head.next_free
        assert first is not None
        prev = self._head
        for b in blocks:
            prev.next_free = b
            b.prev_free = prev
            prev = b
        prev.next_free = first
        first.prev_free = prev
        self.num_free_blocks += len(blocks)

    def block_ids(self) -> list[int]:
        """Free block ids, front to tail (for tests and invariants)."""
        out = []
        cur = self._head.next_free
        while cur is not None and cur is not self._tail:
            out.append(cur.block_id)
            cur = cur.next_free
        return out


def group_key(block_hash: bytes, group_id: int) -> bytes:
    """The hash map key of a block of `group_id` (group 0: the bare hash)."""
    return block_hash if group_id == 0 else block_hash + group_id.to_bytes(4, "big")


class BlockHashMap:
    """block hash -> block, or {block_id: block} when several blocks share a hash."""

    def __init__(self) -> None:
        self._map: dict[bytes, KVCacheBlock | dict[int, KVCacheBlock]] = {}

    def __len__(self) -> int:
        return len(self._map)

    def get_one_block(self, key: bytes) -> KVCacheBlock | None:
        v = self._map.get(key)
        if v is None or isinstance(v, KVCacheBlock):
            return v
        return next(iter(v.values()))

    def insert(self, key: bytes, block: KVCacheBlock) -> None:
        v = self._map.get(key)
        if v is None:
            self._map[key] = block
        elif isinstance(v, KVCacheBlock):
            self._map[key] = {v.block_id: v, block.block_id: block}
        else:
            v[block.block_id] = block

    def pop(self, key: bytes, block_id: int) -> KVCacheBlock | None:
        v = self._map.get(key)
        if v is None:
            return None
        if isinstance(v, KVCacheBlock):
            if v.block_id != block_id:
                return None
            del self._map[key]
            return v
        blk = v.pop(block_id, None)
        if len(v) == 1:
            self._map[key] = next(iter(v.values()))
        elif not v:
            del self._map[key]
        return blk

    def blocks_of(self, key: bytes) -> list[KVCacheBlock]:
        v = self._map.get(key)
        if v is None:
            return []
        return [v] if isinstance(v, KVCacheBlock) else list(v.values())

    def items(self) -> Iterable[tuple[bytes, list[KVCacheBlock]]]:
        for k in self._map:
            yield k, self.blocks_of(k)


class BlockPool:
    """All KV blocks of one engine; see the module docstring for the rules."""

    def __init__(self, num_gpu_blocks: int, enable_caching: bool = True,
                 enable_kv_cache_events: bool = False, int_event_hashes: bool = True):
        if num_gpu_blocks < 2:
            raise ValueError("num_gpu_blocks must be >= 2 (block 0 is the null block)")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.enable_kv_cache_events = enable_kv_cache_events
        self.int_event_hashes = int_event_hashes
        self.blocks = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashMap()
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self._events: list[KVEvent] = []
        self._touched_hashes: list[bytes] = []
        self.track_touches = False

    # --- queries --------------------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        """Every block but the null block: what requests can hold (vLLM's capacity)."""
        return self.num_gpu_blocks - 1

    def get_num_free_blocks(self) -> int:
        """Free blocks, including cached blocks that can be evicted."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        usable = self.num_usable_blocks
        return 1.0 - self.get_num_free_blocks() / usable if usable else 0.0

    def get_cached_block(self, block_hash: bytes, group_id: int = 0) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get_one_block(group_key(block_hash, group_id))

    def _ext(self, block_hash: bytes) -> int | bytes:
        return event_int(block_hash) if self.int_event_hashes else block_hash

    # --- allocation -----------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` from the front of the free queue (evicting cached ones).

        Mutates: free queue, ref counts (set to 1), hash map (evicted hashes), events.
        Raises ValueError when fewer blocks are free.
        """
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot get {num_blocks} free blocks from the pool")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for b in blocks:
            if b.block_hash is not None:
                self._evict_cached_block(b)
            b.ref_cnt = 1
        return blocks

    def _evict_cached_block(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None
        key = group_key(block.block_hash, block.group_id)
        if self.cached_block_hash_to_block.pop(key, block.block_id) is not None:
            if self.enable_kv_cache_events:
                self._events.append(BlockRemoved(block_hashes=[self._ext(block.block_hash)],
                                                 medium=MEDIUM_GPU, group_idx=block.group_id))
        block.block_hash = None
        block.group_id = 0

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the free queue."""
        for b in blocks:
            if b.is_null:
                continue
            if b.ref_cnt == 0:
                self.free_block_queue.remove(b)
            b.ref_cnt += 1
            if self.track_touches and b.block_hash is not None:
                self._touched_hashes.append(b.block_hash)

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block, in the given (eviction-priority) order.

        Blocks reaching ref 0: unhashed ones go to the queue front, hashed ones to the tail.
        """
        unhashed: list[KVCacheBlock] = []
        hashed: list[KVCacheBlock] = []
        for b in ordered_blocks:
            if b.is_null:
                continue
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                (hashed if b.block_hash is not None else unhashed).append(b)
        if unhashed:
            self.free_block_queue.prepend_n(unhashed)
        if hashed:
            self.free_block_queue.append_n(hashed)

    # --- caching --------------------------------------------------------------------------
    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[bytes],
                          num_cached_blocks: int, num_full_blocks: int, block_size: int,
                          token_ids: Sequence[int],
                          extra_keys: Sequence[tuple[Any, ...] | None] | None = None,
                          lora_name: str | None = None, group_id: int = 0,
                          group: KVCacheGroupSpec | None = None) -> None:
        """Hash blocks `[num_cached_blocks, num_full_blocks)` and insert them in the map.

        `blocks` (of group `group_id`, spec `group`; None: a full-attention group) and
        `block_hashes` are the request's (logical order; null blocks, a sliding window's
        freed past, are skipped); `token_ids` are the request's tokens. Emits one
        `BlockStored` for all newly cached blocks, whose parent is the logical previous
        block's hash (None from block 0).
        """
        if num_cached_blocks >= num_full_blocks:
            return
        new_hashes: list[int | bytes] = []
        for i in range(num_cached_blocks, num_full_blocks):
            blk = blocks[i]
            if blk.is_null:
                continue
            assert blk.block_hash is None, f"{blk} is already cached"
            h = block_hashes[i]
            blk.block_hash = h
            blk.group_id = group_id
            self.cached_block_hash_to_block.insert(group_key(h, group_id), blk)
            new_hashes.append(self._ext(h))
        if not self.enable_kv_cache_events:
            return
        parent = self._ext(block_hashes[num_cached_blocks - 1]) if num_cached_blocks else None
        ek = [event_extra_keys(extra_keys[i]) if extra_keys else None
              for i in range(num_cached_blocks, num_full_blocks)]
        self._events.append(BlockStored(
            block_hashes=new_hashes, parent_block_hash=parent,
            token_ids=list(token_ids[num_cached_blocks * block_size:num_full_blocks * block_size]),
            block_size=block_size, lora_id=None, medium=MEDIUM_GPU, lora_name=lora_name,
            extra_keys=ek, group_idx=group_id,
            kv_cache_spec_kind=group.kind if group is not None else FULL_ATTENTION,
            kv_cache_spec_sliding_window=group.sliding_window if group is not None else None))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Fails (False) while any block is in use."""
        num_used = self.num_gpu_blocks - self.get_num_free_blocks()
        if num_used != 1:  # only the null block may be in use
            return False
        self.cached_block_hash_to_block = BlockHashMap()
        for b in self.blocks:
            b.block_hash = None
            b.group_id = 0
        if self.enable_kv_cache_events:
            self._events.append(AllBlocksCleared())
        return True

    # --- events ---------------------------------------------------------------------------
    def take_events(self) -> list[KVEvent]:
        """Drain the events queued since the last call (once per engine step)."""
        events, self._events = self._events, []
        return events

    def take_touched_hashes(self) -> list[bytes]:
        """Drain the hashes of cache hits (recency signal), when `track_touches` is on."""
        touched, self._touched_hashes = self._touched_hashes, []
        return touched

    def cached_hashes(self) -> list[bytes]:
        """Every map key currently in the prefix cache (one per key, duplicates collapsed):
        the bare hash for group 0 (`group_key`)."""
        return [k for k, _ in self.cached_block_hash_to_block.items()]

    # --- invariants -----------------------------------------------------------------------
    def check_invariants(self) -> None:
        """free + used == total; ref counts >= 0; queue holds exactly the ref-0 blocks; every
        hashed block is in the map under its hash and every map entry holds its hash; the
        null block is never free."""
        free_ids = self.free_block_queue.block_ids()
        assert len(free_ids) == self.free_block_queue.num_free_blocks, "free count drift"
        assert len(set(free_ids)) == len(free_ids), "block twice in the free queue"
        free_set = set(free_ids)
        assert self.null_block.block_id not in free_set, "null block in the free queue"
        for b in self.blocks:
            if b.is_null:
                continue
            assert b.ref_cnt >= 0, f"{b} has a negative ref count"
            assert (b.ref_cnt == 0) == (b.block_id in free_set), f"{b} free-queue mismatch"
            if b.block_hash is not None:
                key = group_key(b.block_hash, b.group_id)
                assert b in self.cached_block_hash_to_block.blocks_of(key), \
                    f"{b} is hashed but not in the map"
        for key, blks in self.cached_block_hash_to_block.items():
            assert blks, "empty map entry"
            for b in blks:
                assert b.block_hash is not None and group_key(b.block_hash, b.group_id) == key, \
                    f"{b} in the map under another hash"
        if not self.enable_caching:
            assert len(self.cached_block_hash_to_block) == 0
