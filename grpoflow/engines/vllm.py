"""vLLM colocated with the trainer: a `vllm.LLM` in the training process, fed the policy's weights.

vLLM builds its model from a directory, so the engine starts from the policy's own directory when
it holds a checkpoint, else from a copy saved to a temporary directory. After each optimizer step
the trainer's `(hf_name, tensor)` pairs are pushed by reference into vLLM's in-place reload
(`grpoflow.transport.in_process`; `VLLM_ENABLE_V1_MULTIPROCESSING=0`, set here, keeps the engine
in-process), in `move_model_batches` reloads of whole decoder layers when set. A LoRA policy's
adapters go to vLLM's own LoRA support instead, over the base it holds
(`grpoflow.engines.vllm_adapters`).

Under torchrun every rank builds its own engine on vLLM's `external_launcher` executor, which joins
the run's process group instead of starting its own; `vllm_tensor_parallel_size` ranks may share
one engine sharded over their devices (`grpoflow.engines.colocate` says how the ranks of a group
pool their prompts). Each rank pushes the full weights to its engine; vLLM's weight loaders keep
the rank's shard.

Log-probs: vLLM is built with `logprobs_mode="processed_logprobs"`, so the log-prob it reports
for a sampled token is `log_softmax(logits / temperature)`, as the trainer computes it. With
top_p, top_k or min_p active, vLLM reports the log-prob under the truncated, renormalised
distribution it actually sampled from, and the trainer replays the same filters on its logits
(`replay_sampling_truncation`); a repetition penalty is in vLLM's log-probs only.

vLLM is imported only when an engine is built, so this module's helpers (the sampling-field
mapping) also serve the HTTP client in `remote.py` without vLLM installed. vLLM servers load
grpoflow's worker methods with `--worker-extension-cls grpoflow.engines.vllm.WeightSyncExtension`
(the class lives in `grpoflow.transport.in_process`).
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from grpoflow.engines.base import Completion, EngineCapabilities, EngineOptions, EngineStats, SamplingParams
from grpoflow.engines.colocate import ColocateLayout, EngineGroup, merge_shares, own_share
from grpoflow.engines.vllm_adapters import (
    AdapterSlot,
    adaptable_modules,
    adapter_obstacle,
    adapter_rank,
    lora_layers,
    plain_base_state,
    vllm_max_lora_rank,
)
from grpoflow.options import require, require_fraction, require_min
from grpoflow.transport import in_process
from grpoflow.transport.adapters import split_adapters
from grpoflow.transport.in_process import WeightSyncExtension

logger = logging.getLogger("grpoflow.engines.vllm")

LOGPROBS_MODE = "processed_logprobs"
"""vLLM's log-prob mode giving log_softmax(logits / temperature) of the sampled token."""


def sampling_fields(params: SamplingParams) -> dict:
    """Our sampling parameters as vLLM `SamplingParams` keyword arguments (also the JSON fields of
    vLLM's `/v1/completions`); `logprobs=0` asks for the sampled token's log-prob only."""
    return dict(
        n=params.n,
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k if params.top_k > 0 else -1,
        min_p=params.min_p,
        repetition_penalty=params.repetition_penalty,
        stop_token_ids=list(params.stop_token_ids),
        stop=list(params.stop),
        ignore_eos=params.ignore_eos,
        seed=params.seed,
        logprobs=0,
    )


def penalises_repetition(params: SamplingParams) -> bool:
    """Whether vLLM's log-probs include a repetition penalty, which the trainer does not replay
    (it replays top_p/top_k/min_p: `replay_sampling_truncation`)."""
    return params.repetition_penalty != 1


def finish_reason(reason: str | None, where: str) -> str:
    """vLLM's finish reason as ours: 'stop' or 'length'."""
    if reason in ("stop", "length"):
        return reason
    raise RuntimeError(f"{where} ended a completion with finish_reason={reason!r} (aborted?)")


@dataclass(kw_only=True, slots=True)
class VLLMConfig:
    """vLLM in the training process (`use_vllm: true`, `vllm_mode: colocate`); TRL's and ms-swift's
    names."""

    vllm_gpu_memory_utilization: float = 0.3
    """Fraction of GPU memory a colocated vLLM may take beside the trainer."""
    vllm_max_model_len: int | None = None
    """vLLM's context length; max_prompt_length + max_completion_length when unset."""
    vllm_max_num_seqs: int = 256
    """Most sequences vLLM decodes at once."""
    vllm_enforce_eager: bool = False
    """Skip CUDA-graph capture in vLLM."""
    vllm_enable_prefix_caching: bool = True
    """Let vLLM share KV cache across requests with a common prefix."""
    vllm_tensor_parallel_size: int = 1
    """GPUs (training ranks) per colocated vLLM engine; must divide the number of processes."""
    move_model_batches: int | None = None
    """Push the weights to a colocated vLLM in this many reloads of whole decoder layers, each
    released before the next (bounds the memory of merged or gathered weights); None: one."""
    sleep_level: Literal[0, 1, 2] | None = None
    """Between rollouts (ms-swift's name): 0 keeps the engine's memory through the update (the
    native engine's KV cache with its cached prefixes and CUDA graphs), 1 frees its KV cache, 2
    also vLLM's weights (the native engine's are the policy's: as 1). Unset: 0 for vLLM; for the
    native engine on a GPU, 0 where the memory plan fits the update beside the cache, else 1
    (`run.plan_check.choose_sleep_level`)."""
    vllm_enable_lora: bool = True
    """A LoRA policy: vLLM serves its adapters over the base (adapters alone at each sync after
    the first); false: the merged weights whole at every sync (ms-swift's name; its default is false)."""

    def __post_init__(self) -> None:
        require_fraction("vllm_gpu_memory_utilization", self.vllm_gpu_memory_utilization)
        for name in ("vllm_max_model_len", "vllm_max_num_seqs", "vllm_tensor_parallel_size"):
            value = getattr(self, name)
            require(value is None or value > 0, name, "> 0", value)
        require_min("move_model_batches", self.move_model_batches, 1, " (or null for a single push)")


def model_directory(model: torch.nn.Module, tokenizer) -> tuple[Path, bool]:
    """A directory vLLM can load the policy from, and whether it is a temporary copy.

    The policy's `name_or_path` is used when it is a local checkpoint (config.json plus
    safetensors): its weights are the ones the policy was loaded with; the trainer pushes the live
    weights after a resume, so the directory only has to hold the starting point.
    """
    source = Path(getattr(getattr(model, "config", None), "name_or_path", "") or "")
    if source.name and (source / "config.json").is_file() and any(source.glob("*.safetensors")):
        return source, False
    if not hasattr(model, "save_pretrained"):
        raise TypeError(
            f"the vLLM engine needs a transformers model (save_pretrained) to hand to vLLM; "
            f"got {type(model).__name__}: use rollout_engine=hf for other modules"
        )
    directory = Path(tempfile.mkdtemp(prefix="grpoflow-vllm-model-"))
    # a model with PEFT layers is saved as its base: plain names, adapters off
    state = plain_base_state(model) if lora_layers(model) else None
    model.save_pretrained(directory, state_dict=state)
    tokenizer.save_pretrained(directory)
    return directory, True


class VLLMEngine:
    """Generates with a `vllm.LLM` living in the training process.

    `layout`: this rank's place among the colocated engines of a torchrun run (one engine per
    `tensor_parallel_size` ranks, on vLLM's `external_launcher` executor); the default is a single
    process. `seed` is the engine's own seed (the layout's `engine_seed`). `lora_rank` set: vLLM
    serves a LoRA policy's adapters over the base it holds (`accepts_adapters`): the first sync
    brings the base, unmerged, with the adapters, later ones the adapters alone
    (`grpoflow.engines.vllm_adapters`).
    """

    capabilities: EngineCapabilities
    shares_policy_weights = False

    def __init__(
        self,
        model_dir: str | Path,
        *,
        dtype: str = "auto",
        max_model_len: int = 1024,
        gpu_memory_utilization: float = 0.3,
        max_num_seqs: int = 256,
        enforce_eager: bool = False,
        enable_prefix_caching: bool = True,
        sleep_level: int = 0,
        seed: int = 0,
        layout: ColocateLayout | None = None,
        move_model_batches: int | None = None,
        cleanup_dir: bool = False,
        lora_rank: int | None = None,
    ) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] != "0":
            raise ValueError(
                "the colocated vLLM engine runs in the training process and passes weights by "
                "reference: unset VLLM_ENABLE_V1_MULTIPROCESSING or set it to 0, or use vllm_mode=server"
            )
        if move_model_batches is not None and move_model_batches < 1:
            raise ValueError(f"move_model_batches must be >= 1 or None, got {move_model_batches}")
        from vllm import LLM
        from vllm.platforms import current_platform

        self.model_dir, self._cleanup_dir = Path(model_dir), cleanup_dir
        self.sleep_level, self.move_model_batches = sleep_level, move_model_batches
        self.sleep_supported = current_platform.is_sleep_mode_available()
        self.layout = layout or ColocateLayout()
        self.group = EngineGroup(self.layout)
        self.adapters = AdapterSlot() if lora_rank else None
        # the directory's weights may differ from the policy's (a dtype, an older copy)
        self.holds_base = False
        self.llm = LLM(
            model=str(model_dir),
            dtype=dtype,
            max_model_len=max_model_len,
            gpu_memory_utilization=gpu_memory_utilization,
            max_num_seqs=max_num_seqs,
            enforce_eager=enforce_eager,
            enable_prefix_caching=enable_prefix_caching,
            enable_sleep_mode=self.sleep_supported and sleep_level > 0,
            logprobs_mode=LOGPROBS_MODE,
            worker_extension_cls=f"{WeightSyncExtension.__module__}.{WeightSyncExtension.__qualname__}",
            seed=seed,
            **_launcher_arguments(self.layout),
            **_lora_arguments(lora_rank),
        )
        self.num_layers = self.llm.model_config.get_total_num_hidden_layers()
        self.capabilities = EngineCapabilities(
            name="vllm",
            accepts_adapters=self.adapters is not None,
            max_adapter_rank=lora_rank or None,
            adaptable_modules=self._adaptable_modules(),
            prefix_cache=True,
            model_dir=self.model_dir,
        )
        self.policy_version = 0
        self.stats = EngineStats()
        self._asleep = 0
        self._pending: list[tuple[str, torch.Tensor]] | None = None
        self._last_weights: list[tuple[str, torch.Tensor]] | None = None
        self._warned: set[str] = set()

    def _adaptable_modules(self) -> frozenset[str] | None:
        if self.adapters is None:
            return None
        try:
            return frozenset(self.llm.collective_rpc(adaptable_modules)[0])
        except AttributeError as error:  # another vLLM's internals
            logger.warning("vLLM does not say which layers its LoRA adapters may adapt: %r", error)
            return None

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[list[Completion]]:
        from vllm import SamplingParams as VLLMSamplingParams

        for index, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prompt {index} is empty: give at least one token")
        if penalises_repetition(params):
            self._warn_once(
                "penalised",
                "vLLM reports log-probs with the repetition penalty applied; the trainer's are "
                "unpenalised, so their gap includes the penalty",
            )
        self.wake_up()
        start = time.perf_counter()
        # The ranks sharing this engine run it in lock step: all submit the group's prompts, each
        # with its own rank's sampling parameters, and keep the completions of their own.
        shares = self.group.gather([(list(prompt), sampling_fields(params)) for prompt in prompts])
        requests, sizes = merge_shares(shares)
        outputs = (
            self.llm.generate(
                [{"prompt_token_ids": prompt} for prompt, _ in requests],
                [VLLMSamplingParams(**fields) for _, fields in requests],
                use_tqdm=False,
                lora_request=self.adapters.request if self.adapters else None,
            )
            if requests
            else []
        )
        outputs = own_share(outputs, sizes, self.layout.rank_in_group)
        groups = [[self._completion(sample) for sample in output.outputs] for output in outputs]
        self.stats = EngineStats(
            num_prompt_tokens=sum(map(len, prompts)) * params.n,
            num_generated_tokens=sum(len(c.token_ids) for group in groups for c in group),
            seconds=time.perf_counter() - start,
        )
        return groups

    def _completion(self, sample) -> Completion:
        token_ids = list(sample.token_ids)
        # logprobs=0 gives, per position, a dict holding the sampled token's entry
        logprobs = [step[token].logprob for token, step in zip(token_ids, sample.logprobs or [])]
        assert len(logprobs) == len(token_ids), "vLLM returned no log-prob for some tokens"
        return Completion(
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=finish_reason(sample.finish_reason, "vLLM"),
            policy_version=self.policy_version,
            text=sample.text,
        )

    def update_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Load `(hf_name, tensor)` pairs into vLLM's model (in `move_model_batches` reloads when
        set), or hold them until `wake_up` when vLLM sleeps (its weight memory may be offloaded or
        discarded). Every rank pushes the full weights; under tensor parallelism vLLM keeps the
        rank's shard. With `accepts_adapters`, the adapter tensors among them become vLLM's adapter
        (an update without any, merged weights, leaves the base alone to generate with)."""
        if self.adapters is not None:
            weights, adapters = split_adapters(weights)
            if adapters:
                self.adapters.write(adapters)
            else:
                self.adapters.clear()
            self.holds_base = True
            if not weights:
                self.policy_version = version
                return
        if self._asleep or self.sleep_level == 2 or self.move_model_batches is None:
            weights = [(name, tensor.detach()) for name, tensor in weights]  # references, no copies
        if self._asleep:
            self._pending = weights
        else:
            self._push(weights)
        self.policy_version = version

    def _push(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the pairs (in `move_model_batches` groups of whole layers when set); a level-2
        sleep keeps them to push again at `wake_up`."""
        in_process.push(self.llm, weights, batches=self.move_model_batches, num_layers=self.num_layers)
        self._last_weights = weights if self.sleep_level == 2 else None

    def reset_prefix_cache(self) -> None:
        """Drop vLLM's cached KV blocks (done after every weight update too)."""
        self.llm.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """Free vLLM's memory at the configured `sleep_level` (the trainer's `level` is only a
        request to release memory; the run's vLLM config says how much)."""
        if self.sleep_level == 0 or self._asleep:
            return
        if not self.sleep_supported:
            self._warn_once(
                "sleep",
                f"vLLM has no sleep mode on this platform: sleep_level={self.sleep_level} is "
                "ignored and vLLM keeps its memory between rollouts",
            )
            return
        self.llm.sleep(level=self.sleep_level)
        self._asleep = self.sleep_level

    def wake_up(self) -> None:
        """Take vLLM's memory back; after a level-2 sleep its weights are pushed again (the latest
        trained ones, never the starting checkpoint on disk unless nothing was pushed yet)."""
        if not self._asleep:
            return
        self.llm.wake_up()
        level, self._asleep = self._asleep, 0
        weights = self._pending or (self._last_weights if level == 2 else None)
        self._pending = None
        if weights is not None:
            self._push(weights)
        elif level == 2:
            in_process.reload_directory(self.llm, self.model_dir)
        if level == 2 and self.adapters is not None and self.adapters.request is not None:
            self.adapters.renew()

    def close(self) -> None:
        """Stop vLLM's engine and remove a temporary model copy."""
        engine_core = getattr(self.llm.llm_engine, "engine_core", None)
        if hasattr(engine_core, "shutdown"):
            engine_core.shutdown()
        self.group.close()
        if self.adapters is not None:
            self.adapters.close()
        if self._cleanup_dir:
            shutil.rmtree(self.model_dir, ignore_errors=True)

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(message, stacklevel=3)


def _launcher_arguments(layout: ColocateLayout) -> dict:
    """`vllm.LLM` arguments for this rank's place: under torchrun, vLLM's external_launcher
    executor, which joins the run's process group (RANK and LOCAL_RANK from torchrun) instead of
    starting its own, with the layout's tensor parallelism."""
    if layout.world_size == 1:
        return {}
    return dict(
        distributed_executor_backend="external_launcher",
        tensor_parallel_size=layout.tensor_parallel_size,
    )


def _lora_arguments(lora_rank: int | None) -> dict:
    """`vllm.LLM` arguments serving one LoRA adapter of up to `lora_rank`."""
    if not lora_rank:
        return {}
    return dict(enable_lora=True, max_lora_rank=vllm_max_lora_rank(lora_rank), max_loras=1)


def adapter_sync_rank(model: torch.nn.Module, enable: bool = True) -> int | None:
    """The rank vLLM must serve to take `model`'s LoRA adapters alone at each sync, or None: not
    a LoRA policy, `enable` (vllm_enable_lora) off, or adapters that cannot travel as a LoRA
    adapter (it gets the merged weights whole, as the log says)."""
    if not lora_layers(model):
        return None
    if not enable:
        logger.info("colocated vLLM gets the merged weights whole at every sync: vllm_enable_lora is off")
        return None
    obstacle = adapter_obstacle(model)
    if obstacle is not None:
        logger.info("colocated vLLM gets the merged weights whole at every sync: %s", obstacle)
        return None
    logger.info("colocated vLLM gets the LoRA adapters alone at every sync after the first")
    return adapter_rank(model)


def _dtype_name(model: torch.nn.Module) -> str:
    dtype = next(model.parameters()).dtype
    return str(dtype).removeprefix("torch.")


def build(model: torch.nn.Module, tokenizer, options: EngineOptions) -> VLLMEngine:
    """Registry factory: a colocated vLLM for the policy `model`."""
    config = options.vllm or VLLMConfig()
    layout = ColocateLayout(
        rank=options.rank,
        world_size=options.world_size,
        tensor_parallel_size=config.vllm_tensor_parallel_size,
    )
    directory, temporary = model_directory(model, tokenizer)
    logger.info(
        "colocated vLLM %d of %d (ranks %s) loads the policy from %s",
        layout.engine_index + 1,
        layout.num_engines,
        layout.group_ranks()[layout.engine_index],
        directory,
    )
    return VLLMEngine(
        directory,
        dtype=_dtype_name(model),
        max_model_len=config.vllm_max_model_len or options.max_model_len,
        gpu_memory_utilization=config.vllm_gpu_memory_utilization,
        max_num_seqs=config.vllm_max_num_seqs,
        enforce_eager=config.vllm_enforce_eager,
        enable_prefix_caching=config.vllm_enable_prefix_caching,
        sleep_level=config.sleep_level or 0,
        seed=layout.engine_seed(options.seed),
        layout=layout,
        move_model_batches=config.move_model_batches,
        cleanup_dir=temporary,
        lora_rank=adapter_sync_rank(model, config.vllm_enable_lora),
    )
