"""Block allocation for the paged KV store: pure Python, no tensors.

The store is a flat array of token slots cut into blocks of `block_size` slots. Each request
owns a block table (list of block ids); token position p of a request lives in slot
`table[p // block_size] * block_size + p % block_size`. Block 0 is reserved: its slots are the
"null" token that padding columns read from, so no real token ever lives at slot 0.
"""

from __future__ import annotations


class BlockAllocator:
    def __init__(self, block_size: int, num_blocks: int = 1) -> None:
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self.num_blocks = max(1, num_blocks)
        self.free: list[int] = list(range(self.num_blocks - 1, 0, -1))  # block 0 is the null block
        self.tables: dict[int, list[int]] = {}

    def blocks_needed(self, key: int, num_tokens: int) -> int:
        """How many more blocks `key` needs to hold `num_tokens` tokens."""
        have = len(self.tables.get(key, ()))
        return max(0, -(-num_tokens // self.block_size) - have)

    def reserve(self, key: int, num_tokens: int) -> None:
        """Make the table of `key` cover `num_tokens` tokens; MemoryError when the blocks run out."""
        need = self.blocks_needed(key, num_tokens)
        if need > len(self.free):
            raise MemoryError(f"KV store out of blocks: need {need}, {len(self.free)} free")
        table = self.tables.setdefault(key, [])
        for _ in range(need):
            table.append(self.free.pop())

    def release(self, key: int) -> None:
        self.free.extend(reversed(self.tables.pop(key, [])))

    def slots(self, key: int, start: int, stop: int) -> list[int]:
        """Flat slot indices of token positions [start, stop) of `key`."""
        table, bs = self.tables[key], self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, stop)]

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - 1 - len(self.free)
