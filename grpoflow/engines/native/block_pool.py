"""The KV cache's blocks on the host side: who holds each one, and which hold a known prefix.

Every block has a reference count. With prefix caching on, a full block whose keys and values are
final gets a key, a hash chained over (its parent block's key, its own token ids), so a key names
the whole prefix up to the block's end. A new prompt takes the longest run of keyed blocks that
matches its own chain instead of computing them again. A keyed block that nobody holds stays
keyed in a least-recently-used list and counts as free: `allocate` hands out never-keyed blocks
first and evicts the oldest keyed ones only when those run out.

The pool lives as long as the cache tensor; everything keyed must be dropped (`reset`) whenever
the values in the cache stop matching the model (new weights, a released cache).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

ROOT_KEY = 0
"""The parent key of a sequence's first block."""


def chain_keys(tokens: Sequence[int], block_size: int, num_blocks: int | None = None) -> list[int]:
    """Keys of the first `num_blocks` full blocks of `tokens` (default: every full block); key i
    depends on tokens [0, (i + 1) * block_size) only."""
    count = len(tokens) // block_size if num_blocks is None else num_blocks
    keys, parent = [], ROOT_KEY
    for index in range(count):
        parent = hash((parent, tuple(tokens[index * block_size : (index + 1) * block_size])))
        keys.append(parent)
    return keys


class BlockPool:
    """Free list, reference counts and (with `caching`) the prefix-keyed blocks of one cache."""

    def __init__(self, num_blocks: int, *, caching: bool = False) -> None:
        self.num_blocks, self.caching = num_blocks, caching
        self.released: list[int] = []  # unkeyed blocks given back, reused first
        self.untouched = 0  # blocks [untouched, num_blocks) were never handed out (no list of them)
        self.refs = np.zeros(num_blocks, dtype=np.int32)
        self.block_of: dict[int, int] = {}  # key -> block
        self.key_of: dict[int, int] = {}  # block -> key
        self.idle: OrderedDict[int, None] = OrderedDict()  # keyed blocks nobody holds, oldest first

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out: unkeyed free ones and idle keyed ones."""
        return len(self.released) + self.num_blocks - self.untouched + len(self.idle)

    @property
    def num_cached(self) -> int:
        return len(self.block_of)

    def allocate(self, count: int) -> list[int]:
        """`count` blocks with one holder each, evicting the least recently used idle keyed blocks
        when no unkeyed block is left."""
        assert count <= self.num_free, "caller checks num_free first"
        reused = min(count, len(self.released))
        blocks = [self.released.pop() for _ in range(reused)]
        fresh = min(count - reused, self.num_blocks - self.untouched)
        blocks += range(self.untouched, self.untouched + fresh)
        self.untouched += fresh
        for _ in range(count - len(blocks)):
            block, _ = self.idle.popitem(last=False)
            del self.block_of[self.key_of.pop(block)]
            blocks.append(block)
        self.refs[blocks] = 1
        return blocks

    def share(self, blocks: list[int], times: int = 1) -> None:
        """`times` more holders of each of `blocks`."""
        if times and blocks:
            self.refs[blocks] += times

    def release(self, blocks: list[int]) -> None:
        """One holder fewer for each of `blocks`; a keyed block left with none becomes idle (the
        most recently used), an unkeyed one free."""
        for block in blocks:
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self.key_of:
                    self.idle[block] = None
                else:
                    self.released.append(block)

    def take_cached(self, keys: Sequence[int]) -> list[int]:
        """The blocks of the longest run of `keys` from the first that are all keyed, each with one
        more holder; [] when caching is off."""
        if not self.caching:
            return []
        blocks = []
        for key in keys:
            block = self.block_of.get(key)
            if block is None:
                break
            blocks.append(block)
        for block in blocks:
            if self.refs[block] == 0:
                del self.idle[block]
            self.refs[block] += 1
        return blocks

    def register(self, blocks: Sequence[int], keys: Sequence[int]) -> None:
        """Key each of `blocks` (held, full, values final) with its key. A key already held by
        another block keeps that block, and a block already keyed keeps its key."""
        if not self.caching:
            return
        for block, key in zip(blocks, keys):
            if key not in self.block_of and block not in self.key_of:
                self.block_of[key] = block
                self.key_of[block] = key

    def reset(self) -> None:
        """Forget every key: idle keyed blocks become free, held ones stay held, unkeyed."""
        self.released += list(self.idle)
        self.idle.clear()
        self.block_of.clear()
        self.key_of.clear()
