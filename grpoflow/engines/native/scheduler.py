"""Continuous batching over rows and KV blocks for one `generate` call.

Each running sequence owns a row (its place in the decode batch) and a list of cache blocks. A
waiting item is a prompt with the sequences still to start from it: it is prefilled once, and
its children share its full blocks and get a copy of its last, partial block. When blocks run
out, the most recently admitted sequence is preempted: it frees its row and blocks and waits to
be prefilled again from its prompt and what it has generated so far. Waiting items are queued
per request (a call's own prompts are one; `add` queues one that joins the running call), and the
requests share free rows in turn, so a short request behind a long one's waiting sequences gets
rows at the next admission. A request that waits with no row while another holds more than its
share of them (the rows over the requests with work) takes rows from it: its most recently
admitted sequences are preempted, so a long request holding every row delays a short one by a
step, not until its sequences end.

With prefix caching (`BlockPool.caching`) an item first takes the cached blocks of its longest
known prefix and prefills only the rest, always at least its last token (its logits are sampled).
Its own full prompt blocks are keyed when it is admitted: their values are written by the prefill
launched next, before any later step (or a later item of the same step, whose attention reads the
cache after every item's keys and values are stored) reads them. A sequence's blocks filled by
decoding are keyed when it retires, up to the last token fed to the model.

Steps are scheduled one ahead of their results (the engine launches step t+1 before it reads
step t's tokens), so the scheduler counts tokens in flight (`scheduled`) apart from tokens
recorded, and tags each row with an epoch that changes when the row is retired or preempted:
a result whose row changed hands in between is dropped. The same drop serves `abort`, which stops
the sequences of prompts whose client went away, between two steps.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from grpoflow.engines.native.block_pool import BlockPool, chain_keys
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
    starts: list[int]
    """Tokens of each item whose keys and values are already in its blocks (a cached prefix);
    the item prefills the tokens from there."""
    blocks: list[list[int]]
    """Cache blocks that hold each item's keys and values, the cached prefix's first."""
    copies: list[tuple[int, int]]
    """(source, destination) blocks to copy after the prefill: children's private last blocks."""
    child_item: np.ndarray
    """(C,) item of each child."""
    rows: np.ndarray
    """(C,) row of each child."""
    sequences: np.ndarray
    """(C,) sequence id of each child."""
    token_index: np.ndarray
    """(C,) index of the token each child samples."""
    epochs: np.ndarray
    """(C,) epoch of each row when scheduled."""
    table: np.ndarray
    """(C, max_blocks) block-table rows of the children."""


@dataclass(slots=True)
class DecodeStep:
    """One token for each scheduled row; rows [0, num_rows), the others idle."""

    num_rows: int
    rows: np.ndarray
    """(A,) scheduled rows."""
    sequences: np.ndarray
    """(A,) their sequence ids."""
    token_index: np.ndarray
    """(A,) index of the token each samples."""
    epochs: np.ndarray
    """(A,) epoch of each row when scheduled."""
    positions: np.ndarray
    """(num_rows,) position of the token fed to each row."""
    slots: np.ndarray
    """(num_rows,) cache slot it is written to, -1 for idle rows."""
    context_lens: np.ndarray
    """(num_rows,) tokens attended to, 0 for idle rows."""
    table_updates: tuple[np.ndarray, np.ndarray, np.ndarray]
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
        prefill_wait_steps: int = 0,
    ) -> None:
        """`prefill_wait_steps`: decode steps that waiting sequences fewer than min_prefill_rows
        may be held for others to arrive (requests joining the call) before they are admitted."""
        self.book, self.pool = book, pool
        self.prefill_wait_steps = prefill_wait_steps
        self.steps_waited = 0  # decode steps run since sequences started waiting with rows free
        self.block_size, self.max_prefill_tokens = block_size, max_prefill_tokens
        self.waiting: deque[deque[WorkItem]] = deque()  # a queue per request; preempted ones first
        self.num_waiting = 0
        self.scheduled = np.zeros(0, dtype=np.int64)
        self.sequence_request = np.zeros(0, dtype=np.int64)  # the request each sequence is of
        self.num_requests = 0
        self.add(range(len(book.prompts)))
        self.row_sequence = np.full(max_rows, -1, dtype=np.int64)
        self.row_context = np.zeros(max_rows, dtype=np.int64)
        self.row_num_blocks = np.zeros(max_rows, dtype=np.int64)
        self.row_epoch = np.zeros(max_rows, dtype=np.int64)
        self.table = np.zeros((max_rows, max_blocks), dtype=np.int32)
        self.row_blocks: list[list[int]] = [[] for _ in range(max_rows)]
        self.free_rows = list(range(max_rows))
        self.admission: dict[int, int] = {}
        self.admitted = 0
        self.num_preemptions = 0
        self.num_prefill_tokens = 0  # tokens run through prefill steps
        self.num_cached_tokens = 0  # tokens whose keys and values came from the prefix cache
        self.min_prefill_rows = max(1, max_rows // 8)

    def add(self, prompts: range) -> None:
        """Queue the sequences of `prompts` (the book's last) as one request, behind the others."""
        book = self.book
        self.scheduled = np.concatenate([self.scheduled, book.num_generated[len(self.scheduled) :]])
        joined = np.full(book.num_sequences - len(self.sequence_request), self.num_requests)
        self.sequence_request = np.concatenate([self.sequence_request, joined])
        self.num_requests += 1
        runs = [(book.prompts[index], book.sequences_of(range(index, index + 1))) for index in prompts]
        queue = deque(
            WorkItem(tokens, list(range(run.start, run.stop))) for tokens, run in runs if run.stop > run.start
        )
        self.num_waiting += sum(len(item.sequences) for item in queue)
        if queue:
            self.waiting.append(queue)

    @property
    def num_running(self) -> int:
        return len(self.admission)

    def schedule(self) -> PrefillStep | DecodeStep | None:
        """The next step: a prefill when enough rows are free to make one worth a pass over the
        weights (or nothing runs), else a decode step; None when every running sequence waits
        for its last token and nothing can be admitted. Fewer waiting sequences than
        min_prefill_rows are held up to prefill_wait_steps decode steps for others to join them."""
        if self.waiting:
            free = len(self.free_rows) >= min(self.num_waiting, self.min_prefill_rows)
            gathered = (
                self.num_waiting >= self.min_prefill_rows or self.steps_waited >= self.prefill_wait_steps
            )
            if self.num_running == 0 or (free and gathered) or (not free and self._share_rows()):
                step = self._admit()
                if step is not None:
                    self.steps_waited = 0
                    return step
            self.steps_waited += free
        return self._decode()

    def _share_rows(self) -> bool:
        """Preempt, for the requests that wait with no row, the most recently admitted sequences
        of requests holding more than their share of the rows (at most as many as those requests
        wait with, and `min_prefill_rows`), and queue the starved requests first; whether any row
        was freed."""
        if self.num_requests < 2:  # a call of one request (a training step's) has no one to starve
            return False
        holders = self.sequence_request[self.row_sequence[self.row_sequence >= 0]]
        running = np.bincount(holders, minlength=self.num_requests)
        starving = [
            queue for queue in self.waiting if not running[self.sequence_request[queue[0].sequences[0]]]
        ]
        if not starving:
            return False
        share = max(1, len(self.row_sequence) // (np.count_nonzero(running) + len(starving)))
        wanted = min(sum(len(item.sequences) for queue in starving for item in queue), self.min_prefill_rows)
        freed = 0
        for row in sorted(self.admission, key=self.admission.__getitem__, reverse=True):
            if freed == wanted:
                break
            request = self.sequence_request[self.row_sequence[row]]
            if running[request] > share:
                self._preempt(row)
                running[request] -= 1
                freed += 1
        if freed:
            first = {id(queue) for queue in starving}
            others = [queue for queue in self.waiting if id(queue) not in first]
            self.waiting = deque(starving + others)
        return freed > 0

    def _admit(self) -> PrefillStep | None:
        tokens, starts, blocks, copies, child_item, child_rows = [], [], [], [], [], []
        longest, share = 0, -(-len(self.free_rows) // len(self.waiting))
        while self.waiting and self.free_rows:
            queue = self.waiting[0]
            item = queue[0]
            count = min(len(item.sequences), len(self.free_rows), share)
            length = len(item.tokens)
            keys = chain_keys(item.tokens, self.block_size) if self.pool.caching else []
            cached = self.pool.take_cached(keys[: (length - 1) // self.block_size])
            start = len(cached) * self.block_size
            num_blocks = math.ceil(length / self.block_size) - len(cached)
            partial = length % self.block_size != 0
            reserve = count if self.num_running or tokens else 0
            fits = self.pool.num_free >= num_blocks + (count - 1) * partial + reserve
            if not fits or (
                tokens and (len(tokens) + 1) * max(longest, length - start) > self.max_prefill_tokens
            ):
                self.pool.release(cached)
                break
            longest = max(longest, length - start)
            prompt_blocks = cached + self.pool.allocate(num_blocks)
            self.pool.register(prompt_blocks[len(cached) :], keys[len(cached) :])
            self.num_prefill_tokens += length - start
            self.num_cached_tokens += start
            tokens.append(item.tokens)
            starts.append(start)
            blocks.append(prompt_blocks)
            # The children share the prompt's full blocks; each but the first gets its own copy of
            # a partial last block.
            if partial:
                self.pool.share(prompt_blocks[:-1], count - 1)
                lasts = [prompt_blocks[-1]] + self.pool.allocate(count - 1)
                copies += [(prompt_blocks[-1], last) for last in lasts[1:]]
            else:
                self.pool.share(prompt_blocks, count - 1)
                lasts = [prompt_blocks[-1]] * count
            rows = [heapq.heappop(self.free_rows) for _ in range(count)]
            self._place(rows, item.sequences[:count], prompt_blocks, lasts, length)
            child_item += [len(tokens) - 1] * count
            child_rows += rows
            self.num_waiting -= count
            if count == len(item.sequences):
                queue.popleft()
            else:
                item.sequences = item.sequences[count:]
            self.waiting.popleft()
            if queue:  # the next request's turn
                self.waiting.append(queue)
        if not tokens:
            return None
        rows = np.array(child_rows, dtype=np.int64)
        sequences = self.row_sequence[rows]
        token_index = self.scheduled[sequences].copy()
        self.scheduled[sequences] += 1
        return PrefillStep(
            tokens=tokens,
            starts=starts,
            blocks=blocks,
            copies=copies,
            child_item=np.array(child_item, dtype=np.int64),
            rows=rows,
            sequences=sequences,
            token_index=token_index,
            epochs=self.row_epoch[rows].copy(),
            table=self.table[rows].copy(),
        )

    def _place(
        self, rows: list[int], sequences: list[int], blocks: list[int], lasts: list[int], context: int
    ) -> None:
        """Seat sequences on rows, each with `blocks` whose last entry is replaced by its own `lasts`."""
        self.row_sequence[rows] = sequences
        self.row_context[rows] = context
        self.row_num_blocks[rows] = len(blocks)
        self.table[rows, : len(blocks)] = blocks
        self.table[rows, len(blocks) - 1] = lasts
        for row, last in zip(rows, lasts):
            self.row_blocks[row] = blocks[:-1] + [last]
            self.admission[row] = self.admitted
            self.admitted += 1

    def _decodable_rows(self) -> np.ndarray:
        rows = np.nonzero(self.row_sequence >= 0)[0]
        sequences = self.row_sequence[rows]
        return rows[self.scheduled[sequences] < self.book.limit[sequences]]

    def _decode(self) -> DecodeStep | None:
        block_size = self.block_size
        while True:
            rows = self._decodable_rows()
            if len(rows) == 0:
                return None
            growing = rows[self.row_context[rows] // block_size >= self.row_num_blocks[rows]]
            if len(growing) <= self.pool.num_free:
                break
            self._preempt(max(self.admission, key=self.admission.__getitem__))
        columns = self.row_context[growing] // block_size
        new_blocks = np.array(self.pool.allocate(len(growing)), dtype=np.int64)
        for row, block in zip(growing.tolist(), new_blocks.tolist()):
            self.row_blocks[row].append(block)
        self.row_num_blocks[growing] += 1
        self.table[growing, columns] = new_blocks
        sequences = self.row_sequence[rows]
        token_index = self.scheduled[sequences].copy()
        self.scheduled[sequences] += 1
        num_rows = int(rows.max()) + 1
        positions = np.zeros(num_rows, dtype=np.int64)
        positions[rows] = self.row_context[rows]
        slots = np.full(num_rows, -1, dtype=np.int64)
        pages = self.table[rows, positions[rows] // block_size].astype(np.int64)
        slots[rows] = pages * block_size + positions[rows] % block_size
        context_lens = np.zeros(num_rows, dtype=np.int64)
        context_lens[rows] = positions[rows] + 1
        self.row_context[rows] += 1
        return DecodeStep(
            num_rows=num_rows,
            rows=rows,
            sequences=sequences,
            token_index=token_index,
            epochs=self.row_epoch[rows].copy(),
            positions=positions,
            slots=slots,
            context_lens=context_lens,
            table_updates=(growing, columns, new_blocks),
        )

    def abort(self, prompts: Collection[int]) -> None:
        """Stop the sequences of `prompts` (their client went away): drop them from the queue and
        retire their rows, giving their blocks back; results of theirs still in flight are dropped
        like a preempted row's."""
        stopped = self.book.abort(prompts)
        if not len(stopped):
            return
        doomed = np.zeros(self.book.num_sequences, dtype=bool)
        doomed[stopped] = True
        for item in (item for queue in self.waiting for item in queue):
            alive = [sequence for sequence in item.sequences if not doomed[sequence]]
            self.num_waiting -= len(item.sequences) - len(alive)
            item.sequences = alive
        queues = (deque(item for item in queue if item.sequences) for queue in self.waiting)
        self.waiting = deque(queue for queue in queues if queue)
        for row in np.nonzero(self.row_sequence >= 0)[0].tolist():
            if doomed[self.row_sequence[row]]:
                self._retire(row)

    def _preempt(self, row: int) -> None:
        sequence = int(self.row_sequence[row])
        self.num_preemptions += 1
        self._retire(row)
        self.scheduled[sequence] = self.book.num_generated[sequence]  # its token in flight is dropped
        self.waiting.appendleft(deque([WorkItem(self.book.sequence_tokens(sequence), [sequence])]))
        self.num_waiting += 1

    def _retire(self, row: int) -> None:
        if self.pool.caching:
            self._register_written(row)
        self.pool.release(self.row_blocks[row])
        self.row_blocks[row] = []
        self.row_num_blocks[row] = 0
        self.row_sequence[row] = -1
        self.row_epoch[row] += 1
        del self.admission[row]
        heapq.heappush(self.free_rows, row)

    def _register_written(self, row: int) -> None:
        """Key the row's full blocks whose values are final: every token up to the last recorded
        one, which (like any token in flight after it) may not have been fed to the model."""
        sequence = int(self.row_sequence[row])
        tokens = self.book.sequence_tokens(sequence)
        num_full = (len(tokens) - 1) // self.block_size
        blocks = self.row_blocks[row][:num_full]
        self.pool.register(blocks, chain_keys(tokens, self.block_size, len(blocks)))

    def finish(self, step: PrefillStep | DecodeStep, tokens: np.ndarray, logprobs: np.ndarray) -> None:
        """Record a step's tokens (indexed like step.rows for a prefill, by row for a decode),
        dropping rows that changed hands since, and retire the sequences that are done."""
        current = self.row_epoch[step.rows] == step.epochs
        if isinstance(step, DecodeStep):
            tokens, logprobs = tokens[step.rows], logprobs[step.rows]
        rows, sequences = step.rows[current], step.sequences[current]
        ended = self.book.record(sequences, tokens[current], logprobs[current])
        if len(ended):
            for row in rows[np.isin(sequences, ended)].tolist():
                self._retire(row)
