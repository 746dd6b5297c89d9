"""Continuous batching over rows and KV blocks for one `generate` call.

Each running sequence owns a row (its place in the decode batch) and a list of cache blocks. A
waiting item is a prompt with the sequences still to start from it: it is prefilled once, and
its children share its full blocks and get a copy of its last, partial block. When blocks run
out during decoding, the most recently admitted sequence is preempted: it frees its row and
blocks and waits to be prefilled again from its prompt and what it has generated so far.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from grpoflow.engines.native.kv_cache import BlockPool
from grpoflow.engines.native.requests import RequestBook


@dataclass(slots=True)
class WorkItem:
    """Tokens to prefill and the sequences that start from them."""

    tokens: list[int]
    sequences: list[int]


@dataclass(slots=True)
class PrefillStep:
    """Prompts to run through the model; their children sample their first token."""

    tokens: list[list[int]]
    """Token ids of each item."""
    blocks: list[list[int]]
    """Cache blocks that receive each item's keys and values."""
    copies: list[tuple[int, int]]
    """(source, destination) blocks to copy after the prefill: children's private last blocks."""
    child_item: np.ndarray
    """(C,) item of each child."""
    child_rows: np.ndarray
    """(C,) row of each child."""
    child_sequences: np.ndarray
    """(C,) sequence id of each child."""
    table: np.ndarray
    """(C, max_blocks) block-table rows of the children."""


@dataclass(slots=True)
class DecodeStep:
    """One token for every running row; rows [0, num_rows) with idle ones masked."""

    num_rows: int
    rows: np.ndarray
    """(A,) active rows."""
    sequences: np.ndarray
    """(A,) their sequence ids."""
    positions: np.ndarray
    """(num_rows,) position of the token fed to each row."""
    slots: np.ndarray
    """(num_rows,) cache slot it is written to, -1 for idle rows."""
    context_lens: np.ndarray
    """(num_rows,) tokens attended to, 0 for idle rows."""
    table_updates: tuple[np.ndarray, np.ndarray, np.ndarray] = field(
        default_factory=lambda: (np.zeros(0, np.int64),) * 3
    )
    """(rows, columns, blocks) new block-table entries."""


class Scheduler:
    """Admits, decodes, preempts and retires the sequences of one call."""

    def __init__(
        self,
        book: RequestBook,
        pool: BlockPool,
        *,
        max_rows: int,
        block_size: int,
        max_blocks: int,
        max_prefill_tokens: int,
    ) -> None:
        self.book, self.pool = book, pool
        self.block_size, self.max_prefill_tokens = block_size, max_prefill_tokens
        self.waiting: deque[WorkItem] = deque()
        for index, prompt in enumerate(book.prompts):
            sequences = np.nonzero(book.prompt_of == index)[0].tolist()
            if sequences:
                self.waiting.append(WorkItem(prompt, sequences))
        self.num_waiting = book.num_sequences
        self.row_sequence = np.full(max_rows, -1, dtype=np.int64)
        self.row_context = np.zeros(max_rows, dtype=np.int64)
        self.table = np.zeros((max_rows, max_blocks), dtype=np.int32)
        self.row_blocks: list[list[int]] = [[] for _ in range(max_rows)]
        self.free_rows = list(range(max_rows))
        self.admission: dict[int, int] = {}
        self.admitted = 0
        self.num_preemptions = 0
        self.min_prefill_rows = max(1, max_rows // 8)

    @property
    def num_running(self) -> int:
        return len(self.admission)

    def schedule(self) -> PrefillStep | DecodeStep:
        """The next step: a prefill when enough rows are free to make one worth a pass over the
        weights (or nothing runs), else a decode step over the running rows."""
        if self.waiting:
            worth = min(self.num_waiting, self.min_prefill_rows)
            if self.num_running == 0 or len(self.free_rows) >= worth:
                step = self._admit()
                if step is not None:
                    return step
        assert self.num_running > 0, "a sequence that fits alone can always be admitted"
        return self._decode()

    def _admit(self) -> PrefillStep | None:
        tokens, blocks, copies, child_item, child_rows, child_sequences = [], [], [], [], [], []
        longest = 0
        while self.waiting and self.free_rows:
            item = self.waiting[0]
            count = min(len(item.sequences), len(self.free_rows))
            length = len(item.tokens)
            num_blocks = math.ceil(length / self.block_size)
            partial = length % self.block_size != 0
            reserve = count if self.num_running or tokens else 0
            if self.pool.num_free < num_blocks + (count - 1) * partial + reserve:
                break
            if tokens and (len(tokens) + 1) * max(longest, length) > self.max_prefill_tokens:
                break
            longest = max(longest, length)
            prompt_blocks = self.pool.allocate(num_blocks)
            tokens.append(item.tokens)
            blocks.append(prompt_blocks)
            for child in range(count):
                sequence = item.sequences[child]
                own = list(prompt_blocks)
                if child > 0:
                    shared = prompt_blocks[:-1] if partial else prompt_blocks
                    self.pool.share(shared)
                    if partial:
                        own[-1] = self.pool.allocate(1)[0]
                        copies.append((prompt_blocks[-1], own[-1]))
                row = heapq.heappop(self.free_rows)
                self._place(row, sequence, own, length)
                child_item.append(len(tokens) - 1)
                child_rows.append(row)
                child_sequences.append(sequence)
            self.num_waiting -= count
            if count == len(item.sequences):
                self.waiting.popleft()
            else:
                item.sequences = item.sequences[count:]
        if not tokens:
            return None
        rows = np.array(child_rows, dtype=np.int64)
        return PrefillStep(
            tokens=tokens,
            blocks=blocks,
            copies=copies,
            child_item=np.array(child_item, dtype=np.int64),
            child_rows=rows,
            child_sequences=np.array(child_sequences, dtype=np.int64),
            table=self.table[rows].copy(),
        )

    def _place(self, row: int, sequence: int, blocks: list[int], context: int) -> None:
        self.row_sequence[row] = sequence
        self.row_context[row] = context
        self.row_blocks[row] = blocks
        self.table[row, : len(blocks)] = blocks
        self.admission[row] = self.admitted
        self.admitted += 1

    def _decode(self) -> DecodeStep:
        block_size = self.block_size
        while True:
            rows = np.nonzero(self.row_sequence >= 0)[0]
            num_blocks = np.array([len(self.row_blocks[row]) for row in rows], dtype=np.int64)
            growing = rows[self.row_context[rows] // block_size >= num_blocks]
            if len(growing) <= self.pool.num_free:
                break
            self._preempt(max(self.admission, key=self.admission.__getitem__))
        columns = self.row_context[growing] // block_size
        new_blocks = np.array(self.pool.allocate(len(growing)), dtype=np.int64)
        for row, block in zip(growing.tolist(), new_blocks.tolist()):
            self.row_blocks[row].append(block)
        self.table[growing, columns] = new_blocks
        num_rows = int(rows.max()) + 1
        active = self.row_sequence[:num_rows] >= 0
        positions = np.where(active, self.row_context[:num_rows], 0)
        pages = self.table[np.arange(num_rows), positions // block_size]
        slots = np.where(active, pages.astype(np.int64) * block_size + positions % block_size, -1)
        return DecodeStep(
            num_rows=num_rows,
            rows=rows,
            sequences=self.row_sequence[rows],
            positions=positions,
            slots=slots,
            context_lens=np.where(active, positions + 1, 0),
            table_updates=(growing, columns, new_blocks),
        )

    def _preempt(self, row: int) -> None:
        sequence = int(self.row_sequence[row])
        self.num_preemptions += 1
        self._retire(row)
        self.waiting.appendleft(WorkItem(self.book.sequence_tokens(sequence), [sequence]))
        self.num_waiting += 1

    def _retire(self, row: int) -> None:
        self.pool.release(self.row_blocks[row])
        self.row_blocks[row] = []
        self.row_sequence[row] = -1
        del self.admission[row]
        heapq.heappush(self.free_rows, row)

    def finish_prefill(self, step: PrefillStep, tokens: np.ndarray, logprobs: np.ndarray) -> None:
        """Record the children's first tokens and retire those that are already done."""
        self._finish(step.child_rows, step.child_sequences, tokens, logprobs)

    def finish_decode(self, step: DecodeStep, tokens: np.ndarray, logprobs: np.ndarray) -> None:
        """Record one token per active row (`tokens`, `logprobs` are (num_rows,))."""
        self.row_context[step.rows] += 1
        self._finish(step.rows, step.sequences, tokens[step.rows], logprobs[step.rows])

    def _finish(self, rows: np.ndarray, sequences: np.ndarray, tokens, logprobs) -> None:
        ended = set(self.book.record(sequences, tokens, logprobs).tolist())
        for row, sequence in zip(rows.tolist(), sequences.tolist()):
            if sequence in ended:
                self._retire(row)
