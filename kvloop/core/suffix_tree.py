"""Suffix decoding's data: depth-bounded suffix trees with occurrence counts, and the cache
that holds one tree per running request plus one global tree of earlier responses.

What a tree answers (the facts of Arctic Inference's suffix decoding, arXiv 2411.04975, as
vLLM's `method: "suffix"` uses it; written here from that description):

- It indexes sequences of token ids. Every position of every sequence starts a suffix, cut
  to `max_depth` tokens, so the tree holds every substring of length <= max_depth, and a
  node's `count` is how many times its substring occurs (summed over the sequences).
- `speculate(context)`: for each match length m = 1, 2, ... (< len(context), at most
  max_depth - 1) while the context's last m tokens occur in the tree, walk on from there,
  each time to the most frequent next token (ties: the smaller token id); a token's
  probability is the product of count(child) / count(parent) along the walk, and the walk
  stops before a token under `min_token_prob` or after min(max_spec_tokens,
  floor(max_spec_factor * m)) tokens. A draft's score is the sum of its tokens'
  probabilities; the best score wins, a longer match winning ties.

How it stays small (a compressed trie, built online): an edge holds a run of tokens stored
once, as (sequence id, start, length) into the token lists; a node exists only where counts
change or where some suffix ends, so a tree has O(tokens) nodes. Each active suffix of a
sequence (its last max_depth - 1 start positions) is a "walker" that always ends exactly at
a node's end; appending a token moves every walker one token on (O(max_depth) per token).

Owner: a `SuffixTree` owns its nodes and token lists; the `SuffixCache` owns its trees and
which request's response sits where in the global tree. Pure Python, no locking: the
engine's loop is the only caller.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

Ends = tuple[int, int] | dict[int, int] | None


class _Node:
    """A trie node: the edge into it is `tokens[seq][start:start + length]`, and that
    reference points at an occurrence of the node's whole path (root to here). `ends`: for
    the suffixes that end exactly here, their sequence and end index (one per sequence), so
    that references into a removed sequence can be moved to a live one: None, one
    (seq, end) pair (the usual case) or a dict. `children`: None for a leaf (memory: most
    nodes are leaves)."""

    __slots__ = ("children", "count", "ends", "length", "parent", "seq", "start")

    def __init__(self, parent: _Node | None, seq: int, start: int, length: int, count: int):
        self.parent = parent
        self.seq = seq
        self.start = start
        self.length = length
        self.count = count
        self.children: dict[int, _Node] | None = None
        self.ends: Ends = None

    def child(self, token: int) -> _Node | None:
        return self.children.get(token) if self.children else None

    def add_child(self, token: int, child: _Node) -> None:
        if self.children is None:
            self.children = {}
        self.children[token] = child

    def set_end(self, seq_id: int, end: int) -> None:
        ends = self.ends
        if ends is None or (isinstance(ends, tuple) and ends[0] == seq_id):
            self.ends = (seq_id, end)
        elif isinstance(ends, tuple):
            self.ends = {ends[0]: ends[1], seq_id: end}
        else:
            ends[seq_id] = end

    def pop_end(self, seq_id: int) -> None:
        ends = self.ends
        if isinstance(ends, tuple):
            if ends[0] == seq_id:
                self.ends = None
        elif ends is not None:
            ends.pop(seq_id, None)
            if len(ends) == 1:
                self.ends = next(iter(ends.items()))

    def end_seqs(self) -> dict[int, int]:
        ends = self.ends
        if ends is None:
            return {}
        return {ends[0]: ends[1]} if isinstance(ends, tuple) else ends


@dataclass
class Draft:
    """A speculation: the tokens, their summed probabilities, and the match it came from."""

    token_ids: list[int] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0


class SuffixTree:
    """Suffixes (cut to `max_depth` tokens) of the sequences appended to it, with counts."""

    def __init__(self, max_depth: int):
        if max_depth < 1:
            raise ValueError(f"max_depth must be >= 1, got {max_depth}")
        self.max_depth = max_depth
        self._root = _Node(None, -1, 0, 0, 0)
        self._seqs: dict[int, list[int]] = {}
        self._walkers: dict[int, deque[_Node]] = {}

    # --- building -------------------------------------------------------------------------
    def extend(self, seq_id: int, tokens: Iterable[int]) -> None:
        """Append `tokens` to sequence `seq_id` (a new id starts a sequence)."""
        for token in tokens:
            self.append(seq_id, token)

    def append(self, seq_id: int, token: int) -> None:
        """Append one token: a new suffix starts here, the oldest active one (already
        max_depth long) retires, every other active suffix grows by this token."""
        seq = self._seqs.setdefault(seq_id, [])
        walkers = self._walkers.setdefault(seq_id, deque())
        pos = len(seq)
        seq.append(token)
        self._root.count += 1
        walkers.append(self._root)
        if len(walkers) > self.max_depth:
            walkers.popleft()
        for i, node in enumerate(walkers):
            walkers[i] = self._grow(node, seq_id, pos, token)

    def _grow(self, node: _Node, seq_id: int, pos: int, token: int) -> _Node:
        """The suffix of `seq_id` ending at `node` (at position pos - 1) takes `token`
        (position pos); returns the node where it now ends."""
        if node.count == 1 and node.seq == seq_id and node is not self._root:
            node.length += 1                      # a leaf only this suffix reaches (the
            node.ends = (seq_id, pos + 1)         # usual case in text that does not repeat)
            return node
        child = node.child(token)
        if child is None:
            return self._grow_new(node, seq_id, pos, token)
        if node is not self._root and node.count == child.count + 1:
            return self._grow_merged(node, child, seq_id, pos, token)
        node.pop_end(seq_id)
        if child.length > 1:
            child = self._split(node, child, token)
        child.count += 1
        child.seq, child.start = seq_id, pos + 1 - child.length
        child.set_end(seq_id, pos + 1)
        return child

    def _grow_new(self, node: _Node, seq_id: int, pos: int, token: int) -> _Node:
        """No suffix continued with `token` from here yet: a leaf that only this suffix
        reaches just gets longer; otherwise a new leaf."""
        if node is not self._root and node.count == 1:
            node.seq, node.start = seq_id, pos - node.length
            node.length += 1
            node.ends = (seq_id, pos + 1)
            return node
        leaf = _Node(node, seq_id, pos, 1, 1)
        leaf.ends = (seq_id, pos + 1)
        node.add_child(token, leaf)
        node.pop_end(seq_id)
        return leaf

    def _grow_merged(self, node: _Node, child: _Node, seq_id: int, pos: int,
                     token: int) -> _Node:
        """Only this suffix ends at `node` and everything else goes on into `child`: after
        this token the first token of `child` has node's count, so it joins `node` (and a
        one-token `child` takes node's place)."""
        if child.length == 1:
            parent = node.parent
            assert parent is not None
            key = self._seqs[node.seq][node.start]
            child.length = node.length + 1
            child.parent = parent
            parent.add_child(key, child)
            target = child
        else:
            node.children = {self._seqs[child.seq][child.start + 1]: child}
            child.start += 1
            child.length -= 1
            node.length += 1
            target = node
        target.count = node.count
        target.seq, target.start = seq_id, pos + 1 - target.length
        target.set_end(seq_id, pos + 1)
        return target

    def _split(self, node: _Node, child: _Node, token: int) -> _Node:
        """Cut the first token of `child`'s edge into a node of its own (same count)."""
        head = _Node(node, child.seq, child.start, 1, child.count)
        child.start += 1
        child.length -= 1
        child.parent = head
        head.add_child(self._seqs[child.seq][child.start], child)
        node.add_child(token, head)
        return head

    # --- removing -------------------------------------------------------------------------
    def remove(self, seq_id: int) -> None:
        """Take every suffix of `seq_id` out of the tree and forget its tokens."""
        seq = self._seqs.get(seq_id)
        if seq is None:
            return
        for start in range(len(seq)):
            self._remove_suffix(seq, seq_id, start)
        del self._seqs[seq_id]
        del self._walkers[seq_id]

    def _remove_suffix(self, seq: list[int], seq_id: int, start: int) -> None:
        node = self._root
        node.count -= 1
        path: list[_Node] = []
        idx = start
        while idx < len(seq):
            child = node.child(seq[idx])
            if child is None:
                break
            child.count -= 1
            if child.count == 0:
                _drop_child(node, seq[idx])
                break
            child.pop_end(seq_id)
            idx += child.length
            node = child
            path.append(child)
        if path and node.children is not None and len(node.children) == 1:
            (only,) = node.children.values()
            if only.count == node.count:
                path[-1] = self._merge_into_child(node, only)
        if path:
            self._repoint(path, seq_id)

    def _merge_into_child(self, node: _Node, child: _Node) -> _Node:
        """`node` has one child with the same count: the child takes node's edge too."""
        parent = node.parent
        assert parent is not None
        child.start -= node.length
        child.length += node.length
        child.parent = parent
        parent.add_child(self._seqs[child.seq][child.start], child)
        return child

    def _repoint(self, path: list[_Node], seq_id: int) -> None:
        """Nodes on `path` whose edge refers to `seq_id` get a live occurrence: one that ends
        at a leaf below the path's last node (skipped while that leaf still holds a suffix of
        `seq_id`: a later suffix of it passes here and repoints then)."""
        leaf, distance = path[-1], 0
        while leaf.children:
            leaf = next(iter(leaf.children.values()))
            distance += leaf.length
        ends = leaf.end_seqs()
        if not ends or seq_id in ends:
            return
        ref_seq, end = next(iter(ends.items()))
        end -= distance
        for node in reversed(path):
            end -= node.length
            if node.seq == seq_id:
                node.seq, node.start = ref_seq, end

    # --- asking ---------------------------------------------------------------------------
    def speculate(self, context: Sequence[int], max_spec_tokens: int, max_spec_factor: float,
                  min_token_prob: float) -> Draft:
        """The best draft to follow `context` (see the module docstring); an empty draft
        when nothing matches."""
        context = context[-self.max_depth:]
        best = Draft()
        for match_len in range(1, len(context)):
            found = self._match(context[len(context) - match_len:])
            if found is None:
                break
            limit = min(max_spec_tokens, int(match_len * max_spec_factor + 1e-6))
            draft = self._walk(found[0], found[1], max(limit, 0), min_token_prob)
            if draft.score >= best.score:
                draft.match_len = match_len
                best = draft
        return best

    def _match(self, pattern: Sequence[int]) -> tuple[_Node, int] | None:
        """Where `pattern` ends in the tree: (node, tokens of its edge used), or None."""
        node, idx = self._root, 0
        for token in pattern:
            if idx == node.length:
                child = node.child(token)
                if child is None:
                    return None
                node, idx = child, 0
            if self._seqs[node.seq][node.start + idx] != token:
                return None
            idx += 1
        return node, idx

    def _walk(self, node: _Node, idx: int, max_tokens: int, min_prob: float) -> Draft:
        """The most frequent continuation from (node, idx), while probable enough."""
        draft, prob = Draft(), 1.0
        while len(draft.token_ids) < max_tokens and prob >= min_prob:
            if idx < node.length:
                draft.token_ids.append(self._seqs[node.seq][node.start + idx])
                draft.score += prob
                idx += 1
                continue
            child = _most_frequent(node)
            if child is None:
                break
            prob *= child.count / node.count
            node, idx = child, 0
        return draft

    # --- inspection (tests, memory figures) -----------------------------------------------
    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    @property
    def num_tokens(self) -> int:
        return self._root.count

    def num_nodes(self) -> int:
        """Nodes below the root (walks the tree)."""
        stack, n = [self._root], 0
        while stack:
            node = stack.pop()
            if node.children:
                n += len(node.children)
                stack.extend(node.children.values())
        return n

    def check_invariants(self) -> None:
        """AssertionError unless: every node is its parent's child under its first token,
        refers to a live sequence at an occurrence of its whole path, has a count above 0
        and (below the root) above each child's (no node that could be merged), the path is
        at most max_depth long, and the root counts every token held."""
        assert self._root.count == sum(len(s) for s in self._seqs.values())
        stack: list[tuple[_Node, tuple[int, ...]]] = [(self._root, ())]
        while stack:
            node, path = stack.pop()
            assert node.children is None or node.children
            for key, child in (node.children or {}).items():
                assert child.parent is node and child.count > 0 and child.seq in self._seqs
                assert node is self._root or child.count < node.count
                seq = self._seqs[child.seq]
                full = path + tuple(seq[child.start:child.start + child.length])
                first = child.start + child.length - len(full)
                assert full[len(path)] == key and len(full) <= self.max_depth
                assert first >= 0 and tuple(seq[first:child.start + child.length]) == full
                stack.append((child, full))

    def counts(self) -> dict[tuple[int, ...], int]:
        """Every substring held (length <= max_depth) -> its count, read off the nodes
        (tests compare it with a brute-force count)."""
        out: dict[tuple[int, ...], int] = {}
        stack: list[tuple[_Node, tuple[int, ...]]] = [(self._root, ())]
        while stack:
            node, prefix = stack.pop()
            for child in (node.children or {}).values():
                edge = self._seqs[child.seq][child.start:child.start + child.length]
                for i in range(1, len(edge) + 1):
                    out[prefix + tuple(edge[:i])] = child.count
                stack.append((child, prefix + tuple(edge)))
        return out


def _drop_child(node: _Node, token: int) -> None:
    assert node.children is not None
    del node.children[token]
    if not node.children:
        node.children = None


def _most_frequent(node: _Node) -> _Node | None:
    """The child with the highest count; of equal counts, the smaller token id."""
    best: _Node | None = None
    best_key = 0
    for key, child in (node.children or {}).items():
        if best is None or (child.count, -key) > (best.count, -best_key):
            best, best_key = child, key
    return best


class SuffixCache:
    """Suffix decoding's trees: one per active request (its prompt and output so far) and a
    global one holding the responses (outputs only) of the last `max_cached_requests`
    requests, oldest evicted first; 0 turns the global tree off.

    `start`, `extend` and `stop` bracket a request; `speculate` asks its own tree first and
    the global tree second, the global draft winning only with a strictly higher score.
    A response enters the global tree while it is generated, so it is visible to other
    requests at once; it stays after `stop` until evicted.
    """

    def __init__(self, max_depth: int, max_cached_requests: int):
        self.max_depth = max_depth
        self.max_cached_requests = max_cached_requests
        self.global_tree = SuffixTree(max_depth)
        self._local: dict[str, SuffixTree] = {}
        self._slot: dict[str, int | None] = {}       # active request -> its global seq id
        self._cached: OrderedDict[int, None] = OrderedDict()   # global seq ids, oldest first
        self._next_seq = 0

    @property
    def active_requests(self) -> set[str]:
        return set(self._local)

    @property
    def num_cached_responses(self) -> int:
        return len(self._cached)

    def start(self, request_id: str, prompt: Sequence[int]) -> None:
        """Begin `request_id` with its prompt (ValueError if it is already active); takes a
        global slot for its response, evicting the oldest response beyond the bound."""
        if request_id in self._local:
            raise ValueError(f"request {request_id!r} is already active")
        tree = SuffixTree(self.max_depth)
        tree.extend(0, prompt)
        self._local[request_id] = tree
        self._slot[request_id] = self._new_slot() if self.max_cached_requests else None

    def _new_slot(self) -> int:
        seq_id, self._next_seq = self._next_seq, self._next_seq + 1
        self._cached[seq_id] = None
        while len(self._cached) > self.max_cached_requests:
            oldest, _ = self._cached.popitem(last=False)
            self.global_tree.remove(oldest)
            self._forget_slot(oldest)
        return seq_id

    def _forget_slot(self, seq_id: int) -> None:
        for rid, slot in self._slot.items():
            if slot == seq_id:
                self._slot[rid] = None
                return

    def extend(self, request_id: str, tokens: Sequence[int]) -> None:
        """Output tokens of an active request: into its tree and its global slot."""
        self._local[request_id].extend(0, tokens)
        slot = self._slot[request_id]
        if slot is not None:
            self.global_tree.extend(slot, tokens)

    def stop(self, request_id: str) -> None:
        """Drop the request's own tree; its response stays in the global tree."""
        del self._local[request_id]
        del self._slot[request_id]

    def speculate(self, request_id: str, context: Sequence[int], max_spec_tokens: int,
                  max_spec_factor: float, min_token_prob: float) -> Draft:
        args = (context[-self.max_depth:], max_spec_tokens, max_spec_factor, min_token_prob)
        draft = self._local[request_id].speculate(*args)
        if self.max_cached_requests:
            other = self.global_tree.speculate(*args)
            if other.score > draft.score:
                return other
        return draft
