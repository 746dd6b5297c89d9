"""`NativeEngine`: grpoflow's own rollout engine, generating from the live policy module.

The loop of one `generate` call is: validate, schedule a step (prefill or decode), run it,
record the sampled tokens, until every sequence has finished. Everything that lives across
calls is the KV cache with its prefix-cached blocks, the step buffers and the captured graphs
(the runner's); everything about the requests (the book and the scheduler) is built per call, so
an error in one call leaves nothing behind for the next (a failed call also empties the cache).

The engine reads the policy's parameters in place, so it notices new weights itself: a parameter
with a new address (graphs are captured again, the prefix cache is dropped) or a new version
counter (an optimizer step, a LoRA merge, a copy in `update_weights`: the prefix cache is
dropped). `update_weights` drops the prefix cache in any case, for weights changed where no
counter sees it (a sharded policy gathered into the same storage). A LoRA policy's adapters are
applied in the forward, unmerged (`grpoflow.models.adapters`): the policy is generated from
without a merge.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch
from torch import nn

from grpoflow.engines.base import Completion, EngineCapabilities, EngineStats, PrefillStats, SamplingParams
from grpoflow.engines.native.distributions import DistributionCapture
from grpoflow.engines.native.generic import GenericRunner
from grpoflow.engines.native.model_runner import STEPS_IN_FLIGHT, Launched, Runner, triton_available
from grpoflow.engines.native.requests import Abandoned, RequestBook
from grpoflow.engines.native.routing import RoutingRecord
from grpoflow.engines.native.sampler import SamplingOptions
from grpoflow.engines.native.scheduler import DecodeStep, PrefillStep, Scheduler
from grpoflow.engines.native.sizing import NativeEngineConfig
from grpoflow.models.families import SUPPORTED_MODEL_TYPES, family_model, refusal
from grpoflow.transport.adapters import split_adapters

ON_ERROR = ("raise", "error_completion")
Intake = Callable[[], Sequence[tuple[Sequence[Sequence[int]], Sequence[SamplingParams], Callable]]]
"""Requests that join a running call: prompts, one SamplingParams per prompt, what takes their completions."""
UNIFORM_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "draw")
logger = logging.getLogger("grpoflow.engines.native")


class NativeEngine:
    """Continuous-batching generation straight from `model`'s parameters (no copy, no sync).

    Llama / Mistral / Qwen2 / Qwen3 / Qwen3-MoE / Gemma 3 models run the paged-KV family path (Triton
    kernels and CUDA graphs on CUDA, torch reference ops on the CPU); any other causal LM runs the
    generic path, and the engine logs so once, with the reason when the model's type is a family's.
    """

    capabilities: EngineCapabilities
    shares_policy_weights = holds_base = True

    def __init__(self, model: nn.Module, *, config: NativeEngineConfig | None = None, tokenizer=None) -> None:
        self.model, self.tokenizer = model, tokenizer
        self.config = config = config if config is not None else NativeEngineConfig()
        self.policy_version = 0
        self.stats = EngineStats()
        reason = "force_generic is set" if config.force_generic else refusal(model)
        if config.batch_invariant:  # the kernels' forward (they need Triton), or a one-line refusal
            from grpoflow.models.batch_invariant import BatchInvariantFamily

            reason, self.family = None, BatchInvariantFamily(model)
        else:
            self.family = None if reason else family_model(model)
        if reason:
            _log_generic(model, reason, named=config.force_generic)
        if config.record_routing and (self.family is None or self.family.routing_shape is None):
            why = f"this model runs on the generic path ({reason})" if reason else "this model has no experts"
            raise ValueError(
                f"record_routing needs a mixture-of-experts model on the family path (qwen3_moe); {why}: "
                "unset record_routing"
            )
        self.capabilities = EngineCapabilities(  # the family path adds adapters and caches prefixes
            name="native",
            accepts_adapters=self.family is not None,
            max_adapter_rank=config.max_lora_rank if self.family is not None else None,
            applies_adapters=True,
            per_prompt_params=True,
            aborts=True,
            prefix_cache=self.family is not None,
            distributions=self.family is not None,
            decodes_texts=tokenizer is not None,
            module=model,
        )
        model_config = model.config
        model_limit = getattr(model_config, "max_position_embeddings", None) or getattr(
            model_config, "n_positions", None
        )
        self.max_model_len = config.max_model_len or model_limit or 2048
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        if self.family is not None and config.fuse_projections:
            self.family.fuse_projections()
        self.runner = Runner(self.family, config, self.max_model_len) if self.family else None
        on_cuda = next(model.parameters()).device.type == "cuda"
        use_triton = on_cuda and config.use_triton and triton_available()
        self.generic = None if self.family else GenericRunner(model, config.max_num_seqs, use_triton)
        self.last_capture: DistributionCapture | None = None
        self.weights_signature = self._signature()
        self.weights_versions = self._versions()

    @property
    def path(self) -> str:
        """'family' (paged cache, kernels) or 'generic' (the module with its own cache)."""
        return "family" if self.family else "generic"

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        *,
        on_error: str = "raise",
        abandoned: Abandoned | None = None,
        intake: Intake | None = None,
    ) -> list[list[Completion]]:
        """Sample `n` completions per prompt.

        `params` is one SamplingParams for all prompts or one per prompt (then max_tokens, n, seed,
        stops and ignore_eos may differ; the distribution fields must agree). A bad prompt (empty,
        ids outside the vocabulary, no room for one token, more than the cache can hold) raises
        ValueError naming its index when on_error='raise' (nothing is generated); with
        on_error='error_completion' it gets `n` empty completions with finish_reason 'error' and
        the message as text, and the other prompts are served.

        `abandoned`, called between steps, names the prompts whose completions nobody waits for
        any more (a server's client went away): their sequences stop where they stand, give their
        rows and cache blocks back, and end with finish_reason 'abort'.

        `intake`, called before each step, hands requests that join the call: their prompts take the
        call's next indices (as `abandoned` names them), are checked like its own, must share its
        distribution fields (of `params`), take rows in turn with the other requests', and go to
        their sink once all their sequences have finished (`prompts`' are returned at the end).
        """
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
        with _gc_paused():
            return self._generate(prompts, params, on_error, abandoned or (lambda: ()), intake)

    def _generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams],
        on_error: str,
        abandoned: Abandoned,
        intake: Intake | None,
    ) -> list[list[Completion]]:
        requests = self._per_prompt(prompts, params)
        start = time.perf_counter()
        self.wake_up()
        errors = list(map(self._check, range(len(prompts)), prompts, requests))
        if on_error == "raise" and any(errors):
            raise ValueError("; ".join(error for error in errors if error))
        book = self._book(prompts, requests, errors)
        if self.runner is not None and self.runner.routing_shape is not None:
            width = max(map(len, book.prompts), default=0) + book.tokens.shape[1]
            book.routing = RoutingRecord(
                self.runner.routing_shape, self.family.routing_dtype, book.num_sequences, width
            )
        call = requests[0] if requests else params if isinstance(params, SamplingParams) else SamplingParams()
        options = SamplingOptions.from_params(call)
        joins = _Joins(self, book, intake, call)
        prefill = None
        with torch.inference_mode(), _no_autocast(self.model):
            if self.family:
                extra, prefill = self._run_family(book, options, abandoned, joins)
            else:
                with _eval_mode(self.model):  # LoRA dropout off in PEFT's forward
                    extra = self.generic.run(book, options, abandoned, joins)
        self.stats = EngineStats(
            num_prompt_tokens=sum(len(book.prompts[index]) for index in book.prompt_of),
            num_generated_tokens=int(book.num_generated.sum()),
            seconds=time.perf_counter() - start,
            extra=extra,
            prefill=prefill,
        )
        completions = book.completions(self.policy_version, range(len(prompts)))
        capture, self.last_capture = self.last_capture, None
        if capture is not None:
            for index, group in enumerate(completions):
                for sample, completion in enumerate(group):
                    sequence = book.first_sequence[index] + sample
                    completion.distributions = capture.take(sequence, len(completion.token_ids))
        return completions

    def _book(self, prompts, params: Sequence[SamplingParams], errors: Sequence[str | None]) -> RequestBook:
        # Unseeded requests draw their streams from torch's global generator, so a training
        # run that restores its RNG state from a checkpoint samples exactly as before.
        seed = int(torch.randint(0, 2**62, (1,)).item())
        return RequestBook(
            prompts, params, errors, seed=seed, max_model_len=self.max_model_len, tokenizer=self.tokenizer
        )

    def _run_family(
        self, book: RequestBook, options: SamplingOptions, abandoned: Abandoned, joins: _Joins
    ) -> tuple[dict[str, float], PrefillStats]:
        runner = self.runner
        signature = self._signature()
        if signature != self.weights_signature:
            runner.clear_graphs()  # parameters moved: graphs hold the old addresses
            self.family.refresh_fused()
        versions = self._versions()
        if versions != self.weights_versions or signature != self.weights_signature:
            runner.reset_pool()  # new values: cached keys and values are stale
            self.family.refresh_adapter_copies()
            self.weights_signature, self.weights_versions = signature, versions
        if self.config.fuse_projections and self.family.copy_fused():
            runner.clear_graphs()  # they hold the last call's copies
        try:
            return self._run_steps(book, options, abandoned, joins)
        except BaseException:
            runner.reset_pool()  # blocks of the failed call stay held otherwise
            raise
        finally:
            self.family.drop_fused_copies()

    def _run_steps(
        self, book: RequestBook, options: SamplingOptions, abandoned: Abandoned, joins: _Joins
    ) -> tuple[dict[str, float], PrefillStats]:
        runner = self.runner
        scheduler = Scheduler(
            book,
            runner.pool,
            max_rows=self.config.max_num_seqs,
            block_size=self.config.block_size,
            max_blocks=runner.max_blocks,
            max_prefill_tokens=self.config.max_prefill_tokens,
            prefill_wait_steps=0 if joins.intake is None else self.config.prefill_wait_steps,
        )
        joins.queue = scheduler.add
        runner.begin(options)
        capture = self._capture(options)
        prefill_steps = decode_steps = context_tokens = 0
        in_flight: deque[tuple[PrefillStep | DecodeStep, Launched]] = deque()  # results not read yet
        converted_ahead = False
        started, waited = time.perf_counter(), 0.0
        while True:
            joins()  # requests that join the call, and those that are done
            if book.finished and not in_flight:
                break
            scheduler.abort(abandoned())
            step = scheduler.schedule()
            launched = None
            if step is not None:
                keys = book.keys(step.sequences, step.token_index)
                chosen = capture.select(step.sequences, step.token_index, keys) if capture else None
            if isinstance(step, PrefillStep):
                launched = runner.prefill(step, keys, options)
                prefill_steps += 1
            elif step is not None:
                launched = runner.decode(step, keys, options)
                decode_steps += 1
                context_tokens += int(step.context_lens.sum())
            if launched is not None:
                if capture is not None:
                    by_row = isinstance(step, DecodeStep)
                    launched.distributions = capture.rows_of(
                        runner.step_logits, step.rows[chosen] if by_row else chosen
                    )
                    launched.chosen = chosen
                in_flight.append((step, launched))
            elif not scheduler.waiting and not converted_ahead and joins.intake is None:
                book.convert_ahead()  # nothing left to launch: overlap this with the last steps
                converted_ahead = True
            assert in_flight, "the scheduler stalled"
            if launched is None or len(in_flight) > STEPS_IN_FLIGHT:
                done, results = in_flight.popleft()
                before = time.perf_counter()
                tokens, logprobs = results.wait()
                waited += time.perf_counter() - before
                if results.distributions is not None:
                    chosen = results.chosen
                    current = scheduler.row_epoch[done.rows[chosen]] == done.epochs[chosen]
                    capture.record(
                        done.sequences[chosen], done.token_index[chosen], results.distributions, current
                    )
                if book.routing is not None:
                    _record_routing(book.routing, scheduler, done, results.routing.numpy())
                scheduler.finish(done, tokens, logprobs)
        extra = {
            "prefill_steps": float(prefill_steps),
            "decode_steps": float(decode_steps),
            "decode_context_tokens": float(context_tokens),
            "preemptions": float(scheduler.num_preemptions),
            "prefix_cached_blocks": float(runner.pool.num_cached),
            # The host blocked on the GPU's results for this share of the loop: near 0, the host's
            # per-step work (scheduling, launches) paces the GPU rather than the other way round.
            "steps_seconds": time.perf_counter() - started,
            "gpu_wait_seconds": waited,
        }
        self.last_capture = capture
        return extra, PrefillStats(scheduler.num_prefill_tokens, scheduler.num_cached_tokens)

    def _capture(self, options: SamplingOptions) -> DistributionCapture | None:
        """What keeps the call's next-token distributions at sampled positions
        (`distribution_positions`); None when off or greedy."""
        count = self.config.distribution_positions
        if not count or options.greedy:
            return None
        return DistributionCapture(count, options.inverse_temperature)

    def _per_prompt(self, prompts, params) -> list[SamplingParams]:
        requests = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(requests) != len(prompts):
            raise ValueError(
                f"got {len(requests)} SamplingParams for {len(prompts)} prompts: give one or one per prompt"
            )
        for name in UNIFORM_FIELDS:
            if len({getattr(request, name) for request in requests}) > 1:
                raise ValueError(
                    f"SamplingParams.{name} must be the same for every prompt of one generate call"
                )
        return requests

    def _check(self, index: int, prompt: Sequence[int], request: SamplingParams) -> str | None:
        """Why prompt `index` cannot be served, or None."""
        if len(prompt) == 0:
            return f"prompt {index} is empty: give at least one token"
        if request.max_tokens < 1:
            return f"prompt {index}: max_tokens must be >= 1, got {request.max_tokens}"
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            return f"prompt {index} has token ids outside [0, {self.vocab_size})"
        if len(prompt) >= self.max_model_len:
            return (
                f"prompt {index} has {len(prompt)} tokens, no room for a completion within "
                f"max_model_len={self.max_model_len}: shorten it or raise max_model_len"
            )
        if self.runner is not None:
            total = min(len(prompt) + request.max_tokens, self.max_model_len)
            capacity = self.runner.num_blocks * self.config.block_size
            if math.ceil(total / self.config.block_size) > self.runner.num_blocks:
                return (
                    f"prompt {index} needs up to {total} tokens of KV cache but the cache holds {capacity}: "
                    "raise gpu_memory_utilization or num_kv_blocks, or lower max_tokens"
                )
        return None

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Record the policy version; tensors that are not already the module's own storage are
        copied into the module's parameters (standalone use), LoRA adapters named as
        `grpoflow.transport.adapters` names them are added to their layers (family path; up to
        `max_lora_rank`). A layer whose base weight arrives without an adapter loses the one it
        had: those weights came merged. Every name is checked before anything is written."""
        parameters = dict(self.model.named_parameters(remove_duplicate=False))
        weights, adapters = split_adapters(weights)
        if adapters and self.family is None:
            raise ValueError(
                f"adapter-only updates need the family path ({', '.join(SUPPORTED_MODEL_TYPES)}); "
                "send merged weights to this engine"
            )
        unknown = [name for name, _ in weights if name not in parameters]
        if unknown:
            raise ValueError(f"update_weights: the model has no parameter named {unknown[0]!r}")
        with torch.no_grad():
            if self.family is not None:
                self.family.load_adapters(
                    adapters,
                    max_rank=self.config.max_lora_rank,
                    written=[parameters[name] for name, _ in weights],
                )
            for name, tensor in weights:
                target = parameters[name]
                if target.data_ptr() != tensor.data_ptr():
                    target.copy_(tensor)
        self.policy_version = version
        self.weights_versions = ()  # new values, whatever the version counters say (see `_versions`)
        self.reset_prefix_cache()

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (the next prompts are prefilled whole)."""
        if self.runner is not None:
            self.runner.reset_pool()

    def sleep(self, level: int = 1) -> None:
        """Release the KV cache (cached prefixes included), step buffers and graphs; the weights
        are the policy's and stay (level 2 is the same as level 1)."""
        if self.runner is not None and self.runner.awake:
            self.runner.release()

    def wake_up(self) -> None:
        """Take the KV cache back (generate also does this when needed)."""
        if self.runner is not None and not self.runner.awake:
            self.runner.allocate()

    def close(self) -> None:
        """The weights and the cache are the policy's and the process's: nothing to release."""

    def _signature(self) -> tuple:
        """The parameters' addresses and, for a LoRA policy, which adapters apply: a change
        means graphs captured with the old ones are stale."""
        addresses = tuple(parameter.data_ptr() for parameter in self.model.parameters())
        return addresses + (self.family.adapter_signature() if self.family else ())

    def _versions(self) -> tuple[int, ...]:
        """The parameters' version counters: an in-place write (`copy_`, a foreach optimizer
        step) moves them. A fused optimizer step does not, so `update_weights` marks the values
        new itself: the adapters' copies are then written again before the next call."""
        return tuple(_version_of(parameter) for parameter in self.model.parameters())


class _Joins:
    """The requests that join a running call from `intake` (called between steps; None: none do),
    each handed its completions as soon as its sequences have all finished."""

    def __init__(
        self, engine: NativeEngine, book: RequestBook, intake: Intake | None, call: SamplingParams
    ) -> None:
        self.engine, self.book, self.intake = engine, book, intake
        self.fields = [getattr(call, name) for name in UNIFORM_FIELDS]
        self.queue: Callable[[range], None] = lambda prompts: None  # the scheduler's `add`
        self.open: list[tuple[range, Callable[[list[list[Completion]]], None]]] = []
        self.done = 0  # finished sequences at the last look for finished requests

    def __call__(self) -> None:
        if self.intake is None:
            return
        engine, book, arrivals = self.engine, self.book, self.intake()
        for prompts, params, sink in arrivals:
            if any([getattr(request, name) for name in UNIFORM_FIELDS] != self.fields for request in params):
                raise ValueError(f"a request that joins a call must share its {', '.join(UNIFORM_FIELDS)}")
            errors = list(map(engine._check, range(len(prompts)), prompts, params))
            self.open.append((book.extend(engine._book(prompts, params, errors)), sink))
            self.queue(self.open[-1][0])
        done = int(book.done.sum())
        if arrivals or done != self.done:  # a request may have finished
            self.done = done
            finished = [entry for entry in self.open if book.done[book.sequences_of(entry[0])].all()]
            for prompts, sink in finished:
                sink(book.completions(engine.policy_version, prompts))
            self.open = [entry for entry in self.open if entry not in finished]


def _log_generic(model: nn.Module, reason: str, named: bool) -> None:
    """The one line that says a model runs on the generic path, and why when its type is a family's."""
    model_type = getattr(model.config, "model_type", type(model).__name__)
    line = (
        f"{model_type} runs on the native engine's generic path (no paged cache, CUDA graphs or "
        f"prefix cache; slower): the family path covers {', '.join(SUPPORTED_MODEL_TYPES)}"
    )
    if named or model_type in SUPPORTED_MODEL_TYPES:
        line += f"; the reason here: {reason}"
    logger.info(line)


def _record_routing(
    record: RoutingRecord, scheduler: Scheduler, step: PrefillStep | DecodeStep, routed: np.ndarray
) -> None:
    """Keep a step's routing (`Launched.routing`) for its rows that have not changed hands since."""
    current = scheduler.row_epoch[step.rows] == step.epochs
    if isinstance(step, PrefillStep):
        lengths = np.array([len(tokens) for tokens in step.tokens])
        record.prefill(step.sequences[current], step.child_item[current], lengths, routed)
    else:
        rows = step.rows[current]
        record.decode(step.sequences[current], step.positions[rows], routed.transpose(1, 0, 2)[rows])


def _version_of(tensor: torch.Tensor) -> int:
    try:
        return tensor._version
    except RuntimeError:  # an inference tensor keeps no counter; nothing can write it in place
        return -1


@contextlib.contextmanager
def _gc_paused():
    """No garbage collection inside: a call allocates many lists (its completions, about a
    thousand per 512 sequences), and each young-generation pass over them costs near a millisecond
    while finding nothing to free. Collection resumes, and catches up, afterwards."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def _eval_mode(model: nn.Module):
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


@contextlib.contextmanager
def _no_autocast(model: nn.Module):
    device_type = next(model.parameters()).device.type
    with torch.autocast(device_type=device_type, enabled=False):
        yield
