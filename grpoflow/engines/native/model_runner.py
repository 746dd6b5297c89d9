"""Runs prefill and decode steps of the family forward on the paged cache.

Device state lives here, indexed by row: the next input token of each row (written by the
sampler, so sampled tokens never travel to the host and back), the block table, the step's
positions / slots / context lengths, and the logits. Decode steps replay a CUDA graph captured
once per batch-size bucket (lazily, at first use), so the host issues two launches per step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from grpoflow.engines.base import NonFiniteLogits
from grpoflow.engines.native.block_pool import BlockPool
from grpoflow.engines.native.kv_cache import allocate_cache, num_blocks_for
from grpoflow.engines.native.routing import SlotRouting
from grpoflow.engines.native.sampler import SamplingOptions, sample
from grpoflow.engines.native.scheduler import DecodeStep, PrefillStep
from grpoflow.engines.native.sizing import NativeEngineConfig
from grpoflow.kernels.ops import CachedPrefix, DecodeBatch, TorchOps, prefill_attention
from grpoflow.models.model import FamilyModel

IDLE_ROW = torch.tensor([[0], [-1], [0], [0]])
"""The step metadata (position, cache slot, context length, sampling key) of a row with no work:
it writes no cache slot and attends to nothing."""


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def graph_buckets(max_rows: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then every 16 up to max_rows."""
    small = [size for size in (1, 2, 4, 8) if size < max_rows]
    return small + list(range(16, max_rows, 16)) + [max_rows]


# Decode steps launched ahead of the one whose results are read: the host prepares step t + 2
# while the GPU runs t and t + 1, so a late host (a collection, a busy core) rarely idles the GPU.
# A sequence that stops on a token is decoded for up to this many steps more, then dropped.
STEPS_IN_FLIGHT = 2
HOST_SLOTS = STEPS_IN_FLIGHT + 1  # sets of pinned host buffers, used in turn by successive launches


@dataclass(slots=True)
class Launched:
    """A step on its way: its results land in host buffers once `event` has passed."""

    tokens: torch.Tensor
    logprobs: torch.Tensor
    event: torch.cuda.Event | None
    distributions: torch.Tensor | None = None
    """The log-softmax rows of the step's kept positions (`distributions.DistributionCapture`)."""
    chosen: np.ndarray | None = None
    """Their indices into the step's rows."""
    routing: torch.Tensor | None = None
    """The experts chosen (`routing.SlotRouting`): a prefill's (items, longest, sparse layers, k),
    a decode step's (sparse layers, rows, k); None unless routing is recorded."""

    def wait(self) -> tuple[np.ndarray, np.ndarray]:
        """Block until the step is done; copies of its tokens (int64) and log-probs. Raises
        NonFiniteLogits when a row's logits held NaN or infinity (no token could be sampled)."""
        if self.event is not None:
            self.event.synchronize()
        tokens, logprobs = self.tokens.numpy().copy(), self.logprobs.numpy().copy()
        if not np.isfinite(logprobs).all():
            raise NonFiniteLogits(
                "the model's logits hold NaN or infinity, so no token can be sampled: its weights have "
                "diverged (a learning rate too high, or rewards with huge values) or it was loaded wrong"
            )
        return tokens, logprobs


class Runner:
    """Executes scheduled steps for one FamilyModel; owns the cache and the graphs."""

    def __init__(self, family: FamilyModel, config: NativeEngineConfig, max_model_len: int) -> None:
        self.family, self.config = family, config
        self.device, self.dtype = family.device, family.dtype
        self.max_model_len = max_model_len
        self.max_rows = config.max_num_seqs
        self.block_size = config.block_size
        self.max_blocks = math.ceil(max_model_len / config.block_size)
        cuda = self.device.type == "cuda"
        self.use_triton = cuda and config.use_triton and triton_available()
        self.use_graphs = self.use_triton and config.use_cuda_graphs and family.graph_safe
        self.routing_shape = family.routing_shape if config.record_routing else None
        self.routing: SlotRouting | None = None
        if config.batch_invariant:
            from grpoflow.kernels.batch_invariant_ops import BatchInvariantOps

            self.ops = BatchInvariantOps
        elif self.use_triton:
            from grpoflow.kernels.decoder import TritonOps

            self.ops = TritonOps
        else:
            self.ops = TorchOps
        family.build_rotary_tables(max_model_len)
        self.cache: torch.Tensor | None = None
        self.pool: BlockPool | None = None
        self.num_blocks = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.retired_graph: torch.cuda.CUDAGraph | None = None
        """The last graph `clear_graphs` dropped, kept until the next capture into their pool."""
        self.graph_pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        """The one pool every capture shares, kept across sleeps (`clear_graphs`)."""
        self.capture_stream = torch.cuda.Stream(self.device) if self.use_graphs else None
        self.seen: torch.Tensor | None = None
        self.step_logits: torch.Tensor | None = None
        """The logits the last launched step sampled from (a prefill's by child, a decode's by row)."""

    @property
    def awake(self) -> bool:
        return self.cache is not None

    def allocate(self) -> None:
        """Take the KV cache and the step buffers, in the dtype the weights compute in now (a
        sharded model's gathered weights may differ from its shards: FSDP's mixed precision)."""
        if self.dtype != self.family.dtype:
            self.dtype = self.family.dtype
            self.family.build_rotary_tables(self.max_model_len)
        shape, device = self.family.shape, self.device
        self.num_blocks = num_blocks_for(shape, self.config, self.max_model_len, device, self.dtype)
        self.cache = allocate_cache(shape, self.num_blocks, self.block_size, device, self.dtype)
        self.pool = BlockPool(self.num_blocks, caching=self.config.enable_prefix_caching)
        rows = self.max_rows
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        # positions, slots, context lengths, sampling keys
        self.meta = torch.zeros(4, rows, dtype=torch.int64, device=device)
        self.table_updates = torch.zeros(3, rows, dtype=torch.int64, device=device)  # rows, columns, blocks
        self.block_table = torch.zeros(rows, self.max_blocks, dtype=torch.int32, device=device)
        self.logits = torch.zeros(rows, shape.vocab_size, dtype=self.dtype, device=device)
        pin = device.type == "cuda"
        # one set of host buffers per step in flight and one for the step being prepared
        self.meta_host = torch.zeros(HOST_SLOTS, 4, rows, dtype=torch.int64, pin_memory=pin)
        self.table_host = torch.zeros(HOST_SLOTS, 3, rows, dtype=torch.int64, pin_memory=pin)
        self.tokens_host = torch.zeros(HOST_SLOTS, rows, dtype=torch.int64, pin_memory=pin)
        self.logprobs_host = torch.zeros(HOST_SLOTS, rows, dtype=torch.float32, pin_memory=pin)
        self.launches = 0
        if self.routing_shape is not None:
            self.routing = SlotRouting(
                self.routing_shape,
                self.family.routing_dtype,
                self.num_blocks,
                self.block_size,
                rows,
                HOST_SLOTS,
                device,
            )

    def release(self) -> None:
        """Drop the cache (and what the pool knew of it), the buffers and the graphs (which point
        into them). Their memory stays with the process's caching allocator, where a training
        run's update takes it; handing it back to the driver (`torch.cuda.empty_cache`, as
        `grpoflow serve`'s /sleep does for other processes) would make the update allocate every
        block again, and the next rollout its cache. The graphs' pool stays for the next wake's
        captures (`clear_graphs`): a pool given up would hold its blocks until the allocator next
        ran out of memory."""
        self.clear_graphs()
        self.pool = None
        self.cache = self.input_ids = self.meta = self.block_table = self.logits = None
        self.seen = self.routing = None

    def reset_pool(self) -> None:
        """Every block free and unkeyed: after new weights, or a call that failed half way."""
        if self.pool is not None:
            self.pool = BlockPool(self.num_blocks, caching=self.config.enable_prefix_caching)

    def begin(self, options: SamplingOptions) -> None:
        """Per-call state: the seen-token mask when a repetition penalty is asked for."""
        self.seen = None
        if options.repetition_penalty != 1:
            vocab_size = self.family.shape.vocab_size
            self.seen = torch.zeros(self.max_rows, vocab_size, dtype=torch.bool, device=self.device)

    def prefill(self, step: PrefillStep, keys: np.ndarray, options: SamplingOptions) -> Launched:
        """Run the items' tokens past their cached prefixes, fork the children, sample their first
        tokens (C,)."""
        device, block_size = self.device, self.block_size
        starts = np.array(step.starts, dtype=np.int64)
        lengths = np.array([len(tokens) for tokens in step.tokens], dtype=np.int64)
        num_items, length = len(step.tokens), int((lengths - starts).max())
        ids = np.zeros((num_items, length), dtype=np.int64)
        slots = np.full((num_items, length), -1, dtype=np.int64)
        for item, (tokens, start, blocks) in enumerate(zip(step.tokens, step.starts, step.blocks)):
            position = np.arange(start, len(tokens))
            ids[item, : len(position)] = tokens[start:]
            slots[item, : len(position)] = (
                np.array(blocks)[position // block_size] * block_size + position % block_size
            )
        # (G, L); padding repeats the last position
        positions = np.minimum(starts[:, None] + np.arange(length)[None, :], lengths[:, None] - 1)
        last = np.arange(num_items) * length + lengths - starts - 1
        shape, family = self.family.shape, self.family
        positions_t, slots_t = _to(positions.reshape(-1), device), _to(slots.reshape(-1), device)
        prefix = None
        if starts.any() or getattr(self.ops, "paged_prefill", False):  # attend over the cache
            pages = np.zeros((num_items, max(map(len, step.blocks))), dtype=np.int64)
            for item, blocks in enumerate(step.blocks):
                pages[item, : len(blocks)] = blocks
            prefix = CachedPrefix(*(_to(a, device) for a in (pages, positions, lengths)), block_size)

        def attend(index, q, k, v, qk_norm):
            caches = self.cache[index]
            cos, sin = family.rotary[family.rotary_of[index]]
            self.ops.rope_and_store(q, k, v, cos, sin, positions_t, slots_t, caches[0], caches[1], qk_norm)
            q = q.view(num_items, length, shape.num_heads, shape.head_dim)
            if prefix is not None:
                out = self.ops.cached_prefill_attention(
                    q, caches[0], caches[1], prefix, family.scale, family.windows[index]
                )
            else:
                k = k.view(num_items, length, shape.num_kv_heads, shape.head_dim)
                v = v.view(num_items, length, shape.num_kv_heads, shape.head_dim)
                out = prefill_attention(q, k, v, family.scale, family.windows[index])
            return out.reshape(num_items * length, shape.num_heads, shape.head_dim)

        routing = self.routing.buffer(ids.size) if self.routing is not None else None
        logits = family.forward(
            _to(ids.reshape(-1), device), attend, self.ops, last_index=_to(last, device), routing=routing
        )
        if routing is not None:
            self.routing.store(slots_t, routing)
        if step.copies:
            source, destination = (_to(np.array(column), device) for column in zip(*step.copies))
            self.cache[:, :, destination] = self.cache[:, :, source]
            if self.routing is not None:
                self.routing.copy_blocks(source, destination)
        rows = _to(step.rows, device)
        self.block_table[rows] = _to(step.table, device)
        child_logits = logits[_to(step.child_item, device)]
        self.step_logits = child_logits  # indexed like step.rows
        seen = None
        if self.seen is not None:
            self._mark_prompts(step)
            seen = self.seen[rows]
        tokens, logprobs = sample(
            child_logits,
            _to(keys, device),
            options,
            seen=seen,
            use_triton=self.use_triton,
            invariant_scores=self.config.batch_invariant,
        )
        self.input_ids[rows] = tokens
        if self.seen is not None:
            self.seen[rows, tokens] = True
        routed = None
        if self.routing is not None:
            routed = self.routing.items_to_host(step.blocks, [len(item) for item in step.tokens])
        return self._send_back(tokens, logprobs, routed)

    def _mark_prompts(self, step: PrefillStep) -> None:
        rows = _to(step.rows, self.device)
        self.seen[rows] = False
        for row, item in zip(step.rows.tolist(), step.child_item.tolist()):
            self.seen[row, _to(np.array(step.tokens[item]), self.device)] = True

    def decode(self, step: DecodeStep, keys: np.ndarray, options: SamplingOptions) -> Launched:
        """One token for rows [0, num_rows) (tokens and log-probs indexed by row)."""
        rows = step.num_rows
        if self.use_graphs:
            rows = next(size for size in graph_buckets(self.max_rows) if size >= step.num_rows)
            self._ensure_graph(rows)
        # Everything the step needs goes up through pinned buffers (one set per step in flight), so
        # the copies are asynchronous and the host can prepare the next steps while this one runs.
        host = self.meta_host[self.launches % HOST_SLOTS]
        host[:, :rows] = IDLE_ROW
        host[0, : step.num_rows] = torch.from_numpy(step.positions)
        host[1, : step.num_rows] = torch.from_numpy(step.slots)
        host[2, : step.num_rows] = torch.from_numpy(step.context_lens)
        host[3, step.rows] = torch.from_numpy(keys)
        self.meta[:, :rows].copy_(host[:, :rows], non_blocking=True)
        num_updates = len(step.table_updates[0])
        if num_updates:
            staged = self.table_host[self.launches % HOST_SLOTS, :, :num_updates]
            staged.copy_(torch.from_numpy(np.stack(step.table_updates)))
            updates = self.table_updates[:, :num_updates]
            updates.copy_(staged, non_blocking=True)
            self.block_table[updates[0], updates[1]] = updates[2].to(torch.int32)
        if self.use_graphs:
            self.graphs[rows].replay()
        else:
            self._decode_forward(rows, int(step.context_lens.max()))
        seen = self.seen[:rows] if self.seen is not None else None
        self.step_logits = self.logits  # indexed by row
        tokens, logprobs = sample(
            self.logits[:rows],
            self.meta[3, :rows],
            options,
            seen=seen,
            use_triton=self.use_triton,
            tokens_out=self.input_ids[:rows],  # the next step's input, with no copy
            invariant_scores=self.config.batch_invariant,
        )
        if self.seen is not None:
            self.seen[torch.arange(rows, device=self.device), tokens] = True
        routed = None
        if self.routing is not None:
            routed = self.routing.step_to_host(self.launches % HOST_SLOTS, step.num_rows)
        return self._send_back(tokens[: step.num_rows], logprobs[: step.num_rows], routed)

    def _send_back(
        self, tokens: torch.Tensor, logprobs: torch.Tensor, routing: torch.Tensor | None = None
    ) -> Launched:
        """Start the copy of a step's results to the host; `Launched.wait` gives them."""
        slot = self.launches % HOST_SLOTS
        self.launches += 1
        count = tokens.shape[0]
        self.tokens_host[slot, :count].copy_(tokens, non_blocking=True)
        self.logprobs_host[slot, :count].copy_(logprobs, non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return Launched(
            self.tokens_host[slot, :count], self.logprobs_host[slot, :count], event, routing=routing
        )

    def _decode_forward(self, rows: int, max_context: int) -> None:
        cache, family, ops = self.cache, self.family, self.ops
        batches = [  # one per rotary table
            DecodeBatch(
                cos=cos,
                sin=sin,
                positions=self.meta[0, :rows],
                slots=self.meta[1, :rows],
                block_table=self.block_table[:rows],
                context_lens=self.meta[2, :rows],
                max_context=max_context,
            )
            for cos, sin in family.rotary
        ]

        def attend(index, q, k, v, qk_norm):
            batch, window = batches[family.rotary_of[index]], family.windows[index]
            return ops.decode_layer_attention(
                q, k, v, cache[index, 0], cache[index, 1], batch, family.scale, window, qk_norm
            )

        routing = self.routing.step[:, :rows] if self.routing is not None else None
        family.forward(self.input_ids[:rows], attend, ops, logits_out=self.logits[:rows], routing=routing)
        if routing is not None:
            self.routing.store(batches[0].slots, routing)

    def clear_graphs(self) -> None:
        """Drop the captured graphs (their weights or copies moved). The last one is kept until
        the next capture ends: the allocator refuses a capture into a pool whose graphs are all
        gone, and a fresh pool each time would leave the old ones' memory to the next
        `empty_cache`."""
        if self.graphs:
            self.retired_graph = self.graphs.popitem()[1]
        self.graphs.clear()

    def _ensure_graph(self, rows: int) -> None:
        """Capture the decode forward for `rows` rows, run once first to compile the kernels.
        While capturing, the rows are idle (no cache writes, nothing attended). The capture runs
        on a side stream as `torch.cuda.graph` does, without its `gc.collect` and `empty_cache`:
        those cost a capture tens of milliseconds, and handed the update's cached blocks back to
        the driver, which the update then allocated again. It forbids unsafe CUDA calls in this
        thread alone (`thread_local`), so other threads' work (a layer compiling beside training,
        a server's) neither fails nor breaks the capture."""
        if rows in self.graphs:
            return
        self.meta[:, :rows] = IDLE_ROW.to(self.device)
        self._decode_forward(rows, 0)
        graph, stream = torch.cuda.CUDAGraph(), self.capture_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            graph.capture_begin(pool=self.graph_pool, capture_error_mode="thread_local")
            try:
                self._decode_forward(rows, 0)
            finally:
                graph.capture_end()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        self.graphs[rows] = graph
        self.retired_graph = None


def _to(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(device, non_blocking=True)
