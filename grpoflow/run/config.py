"""A training run's configuration: the components' own configs composed into one tree.

Each component owns the dataclass of its settings (the policy's loading and LoRA in
`grpoflow.policy`, prompts in `grpoflow.data`, sampling and engine sizes in `grpoflow.engines`,
rewards in `grpoflow.rewards`, the objective in `grpoflow.learn.objective`, ...); this module
composes them and holds what belongs to the run itself (the group size and engine choice, the
schedule, checkpoints, weight syncs, asynchronous generation). Users write flat keys with the names
they know from TRL's GRPOConfig and ms-swift (`learning_rate`, `num_generations`, `beta`, ...), in
YAML or as `--key value` flags; `grpoflow.options` gives each key exactly one owner in this tree and
builds it, each section checking its own values. The rules that span sections are checked once,
when the tree is built (`GRPOConfig.__post_init__`).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from grpoflow import options
from grpoflow.agents.atropos_client import AtroposConfig
from grpoflow.agents.config import AgentConfig
from grpoflow.data.prompts import DataConfig
from grpoflow.engines.base import EngineConfig, SamplingParams
from grpoflow.engines.vllm import VLLMConfig
from grpoflow.learn.objective import AlgorithmConfig
from grpoflow.learn.update import ImportanceCorrection, UpdateSettings, replayed_truncation
from grpoflow.options import require, require_min
from grpoflow.policy.loading import PolicyConfig
from grpoflow.policy.lora import AdapterConfig
from grpoflow.policy.placement_config import PlacementConfig
from grpoflow.remote.engine import RemoteConfig
from grpoflow.rewards.params import RewardConfig
from grpoflow.run.config_rules import SpanningRules
from grpoflow.run.evaluation import EvalConfig
from grpoflow.run.health import HealthConfig
from grpoflow.run.metrics import LogConfig
from grpoflow.run.plan_check import PlanConfig
from grpoflow.run.trainer import LoopSettings
from grpoflow.run.training_config import TrainingConfig
from grpoflow.run.weight_sync import WeightSyncConfig

logger = logging.getLogger("grpoflow")

KEY_ALIASES = {"overlong_filter": "mask_truncated_completions", "rlhf_type": None}
"""Other names users know for a key; None marks keys accepted and ignored (always GRPO here)."""
LEGACY_SECTIONS = ("reward_params",)
"""Section names of earlier recipes whose keys are read as flat keys."""


@dataclass(kw_only=True, slots=True)
class GenerationConfig:
    """How completions are sampled, and by which engine."""

    num_generations: int = 8
    """Completions per prompt (G)."""
    sampling: SamplingParams = field(default_factory=SamplingParams)
    """The sampling fields (max_completion_length, temperature, top_p, top_k, min_p,
    repetition_penalty, stop), as every engine reads them."""
    rollout_engine: Literal["auto", "hf", "native"] = "auto"
    """Generation backend: native (grpoflow's engine), hf (transformers generate), auto (native)."""
    use_vllm: bool = False
    """Generate with vLLM instead of the native/hf engines."""
    vllm_mode: Literal["colocate", "server"] = "colocate"
    """colocate: vLLM inside the trainer's process; server: a separate `vllm serve` or
    `grpoflow serve`."""
    num_infer_workers: int = 0
    """Rollout GPUs per node beside the NPROC_PER_NODE training ones: the run starts a
    `grpoflow serve` on each and trains against them in server mode (0: none)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Sizes of the native engine (gpu_memory_utilization, max_num_seqs, max_model_len)."""
    distribution_check_positions: int = 64
    """Sampled positions per engine call at which the trainer compares the engine's whole
    next-token distribution with its own (`sampling/distribution_{tv,kl}/{mean,max}`; native
    engine; 0: off)."""
    on_policy_sampling: bool = False
    """Native engine: make every completion token an exact draw from the trainer's own forward
    (the trainer replays the engine's keyed draws on its logits and the engine continues from the
    first disagreement), so the sampled tokens' log-probs are the trainer's (grpoflow.rollout.on_policy);
    for single-turn completions and the turns of tool or environment episodes
    (grpoflow.rollout.on_policy_episodes); an agent program's turns under the update's check only."""
    batch_invariant: bool | Literal["auto"] = "auto"
    """Run the training forward and the native engine's forward on the batch-invariant kernels,
    whose logits agree bit for bit, so on_policy_sampling needs no replay (on_policy_check) or one
    round of it (torch_compile off);
    auto: on with on_policy_sampling on CUDA (grpoflow.policy.batch_invariant)."""
    on_policy_check: Literal["auto", "replay", "update"] = "auto"
    """How on_policy_sampling makes each token the trainer's own draw. replay: the trainer redraws
    every token on its forward before the update, rounds until all agree. update: the engine's
    draws stand, its forward on the trainer's batch-invariant kernels giving the trainer's logits
    bit for bit, and the update leaves out of the loss a completion with any token whose engine
    log-prob differs from the trainer's (`on_policy/unverified_fraction`); no top-k/top-p/min-p.
    auto: update where the batch-invariant kernels run and nothing truncates, else replay."""

    def __post_init__(self) -> None:
        require_min("num_generations", self.num_generations, 2, " (group-relative advantages need a group)")
        require_min("distribution_check_positions", self.distribution_check_positions, 0)
        require(
            self.sampling.temperature > 0,
            "temperature",
            "> 0 (log-probs are taken on logits divided by it)",
            self.sampling.temperature,
        )
        require_min("num_infer_workers", self.num_infer_workers, 0)
        engine = self.engine_name
        require(self.on_policy_check in ("auto", "replay", "update"), "on_policy_check",
                "auto, replay or update", self.on_policy_check)  # fmt: skip
        require(self.on_policy_check == "auto" or self.on_policy_sampling, "on_policy_check",
                "auto without on_policy_sampling", self.on_policy_check,
                "set on_policy_sampling: true, or leave on_policy_check unset")  # fmt: skip
        require(self.on_policy_check != "update" or (self.batch_invariant is not False
                and not self.sampling.truncation.active), "on_policy_check",
                "replay or auto with batch_invariant: false or top-k/top-p/min-p", "update",
                "the update's check needs the engine on the batch-invariant kernels and the "
                "untruncated distribution")  # fmt: skip
        require(self.batch_invariant is not True or engine == "native", "batch_invariant",
                f"auto or false with the {engine} engine", True, "use rollout_engine: native")  # fmt: skip
        if self.rollout_engine != "auto" and self.engine_name.startswith("vllm"):
            logger.warning("rollout_engine=%s is ignored: the run generates with vLLM", self.rollout_engine)

    @property
    def max_completion_length(self) -> int:
        """Most new tokens per completion."""
        return self.sampling.max_tokens

    @property
    def engine_name(self) -> str:
        """The registered rollout engine these settings choose."""
        if self.num_infer_workers or (self.use_vllm and self.vllm_mode == "server"):
            return "vllm_server"
        if self.use_vllm:
            return "vllm"
        return "native" if self.rollout_engine == "auto" else self.rollout_engine


@dataclass(kw_only=True, slots=True)
class OffPolicyConfig:
    """Asynchronous generation, and the correction of rollouts the trainer's policy did not sample."""

    async_generate: bool = False
    """Generate the next step's batch while training on this one (server mode): the batch is
    sampled by the policy one sync older."""
    max_staleness: int = 1
    """Most policy versions a batch's sampling policy may lag the trainer's at its update."""
    correction: ImportanceCorrection = field(default_factory=ImportanceCorrection)
    """The importance-sampling correction (vllm_importance_sampling_*)."""

    def __post_init__(self) -> None:
        note = " (a batch generated during the previous update is one version old)"
        require_min("max_staleness", self.max_staleness, 1, note)


@dataclass(kw_only=True)
class GRPOConfig(SpanningRules):
    """Everything a run needs, one section per component."""

    policy: PolicyConfig = field(default_factory=PolicyConfig)
    """The model being trained and how it loads (grpoflow.policy.loading)."""
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    """Full fine-tuning or LoRA adapters (grpoflow.policy.lora)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Where prompts come from (grpoflow.data.prompts)."""
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    """Group size, sampling and the engine that samples."""
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    """A colocated vLLM engine (grpoflow.engines.vllm)."""
    remote: RemoteConfig = field(default_factory=RemoteConfig)
    """Rollout servers over HTTP (grpoflow.remote.engine)."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """The GRPO-family objective (grpoflow.learn.objective)."""
    rewards: RewardConfig = field(default_factory=RewardConfig)
    """Which rewards score completions, and their parameters (grpoflow.rewards)."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Multi-turn episodes: tools, an environment, turn limits (grpoflow.agents)."""
    atropos: AtroposConfig = field(default_factory=AtroposConfig)
    """Training on the scored groups of Atropos environments (grpoflow.agents.atropos_client)."""
    training: TrainingConfig = field(default_factory=TrainingConfig)
    """Optimisation, schedule, checkpoints."""
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """FSDP and offloading (grpoflow.policy.placement)."""
    sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    """Weight syncs to engines that keep their own copy."""
    off_policy: OffPolicyConfig = field(default_factory=OffPolicyConfig)
    """Asynchronous generation and the importance-sampling correction."""
    log: LogConfig = field(default_factory=LogConfig)
    """What gets logged where (grpoflow.run.metrics)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation on held-out prompts and the best checkpoint (grpoflow.run.evaluation)."""
    health: HealthConfig = field(default_factory=HealthConfig)
    """Checks on each step's metrics that warn or stop the run (grpoflow.run.health)."""
    plan: PlanConfig = field(default_factory=PlanConfig)
    """The memory plan made before step 1 (grpoflow.run.plan_check)."""

    def __post_init__(self) -> None:
        options.apply_derived(self)  # e.g. the rewards read the generation's completion budget
        self.validate()

    @property
    def generation_batch_size(self) -> int:
        """Completions generated per step and rank."""
        return self.training.micro_batch_size * self.training.gradient_accumulation_steps

    @property
    def max_model_len(self) -> int:
        """Longest prompt plus completion an engine must hold."""
        return self.data.max_prompt_length + self.generation.max_completion_length

    def step_sampling(self, eos_token_id: int | None) -> SamplingParams:
        """A step's sampling: num_generations completions per prompt, stopping at `eos_token_id`."""
        stop = [eos_token_id] if eos_token_id is not None else []
        return dataclasses.replace(
            self.generation.sampling, n=self.generation.num_generations, stop_token_ids=stop
        )

    def update_settings(self, copies_weights: bool, exact_draws: bool = False) -> UpdateSettings:
        """What the update phase reads; `copies_weights`: the engine keeps its own copy of the
        weights, so the importance-sampling correction is on unless set off; `exact_draws`: the
        update checks the engine's draws bit for bit (`on_policy_check: update`)."""
        correction = self.off_policy.correction
        corrects = correction.vllm_importance_sampling_correction
        return UpdateSettings(
            algorithm=self.algorithm,
            micro_batch_size=self.training.micro_batch_size,
            temperature=self.generation.sampling.temperature,
            max_completion_length=self.generation.max_completion_length,
            max_grad_norm=self.training.max_grad_norm,
            sampling_correction=correction if (copies_weights if corrects is None else corrects) else None,
            exact_draws=exact_draws,
            truncation=replayed_truncation(self.generation.sampling, self.algorithm),
            padding_free=self.training.padding_free,
            shared_prompts=bool(self.training.shared_prompts),
            max_tokens_per_micro_batch=self.training.max_tokens_per_micro_batch,
            group_by_length=self.groups_by_length(),
        )

    def loop_settings(self, total_steps: int, steps_per_epoch: float | None = None) -> LoopSettings:
        """What the training loop reads, for a run of `total_steps` (`steps_per_epoch`: the steps
        that take every prompt once; None when the prompts come from a service)."""
        return LoopSettings(
            total_steps=total_steps,
            steps_per_epoch=steps_per_epoch,
            logging_steps=self.log.logging_steps,
            log_completions=self.log.log_completions,
            mask_truncated_completions=self.algorithm.mask_truncated_completions,
            kl_in_reward=self.algorithm.kl_in_reward,
            stop_on_nonfinite=self.health.health_nonfinite != "off",
            max_consecutive_reward_failures=self.rewards.max_consecutive_reward_failures,
            eval=self.eval,
            flat_config=self.to_flat_dict(),
        )

    def groups_by_length(self) -> bool:
        """`group_by_length`, or when unset: on unless the micro-batches' make-up changes the loss
        (bnpo, top_entropy_quantile < 1) or the update shares prompts (its rows packed, without
        padding to save, and a group's rows must stay together)."""
        if self.training.group_by_length is not None:
            return self.training.group_by_length
        if self.training.shared_prompts:
            return False
        return self.algorithm.loss_type != "bnpo" and self.algorithm.top_entropy_quantile >= 1.0

    def total_steps(self, num_prompts: int, world_size: int = 1) -> int:
        """Training steps over `world_size` ranks: max_steps, or enough global generation batches
        (world_size times a rank's) for num_train_epochs."""
        if self.training.max_steps > 0:
            return self.training.max_steps
        return max(
            1, math.ceil(self.training.num_train_epochs * self.steps_per_epoch(num_prompts, world_size))
        )

    def steps_per_epoch(self, num_prompts: int, world_size: int = 1) -> float:
        """Steps over `world_size` ranks that take each of `num_prompts` prompts once."""
        return num_prompts / (world_size * self.generation_batch_size // self.generation.num_generations)

    def validate(self) -> None:
        """The rules that span sections."""
        require(
            self.policy.model is not None,
            "model",
            "set",
            None,
            "pass --model (a local directory or hub id), or run the embedded default with "
            "`grpoflow train` and no arguments",
        )
        if self.atropos.enabled:
            self._validate_atropos()
            return
        if self.agent.environment is not None and not self.data.dataset:
            self.data.dataset = [self.agent.environment]  # a library environment brings its tasks
        require(
            bool(self.data.dataset),
            "dataset",
            "set",
            [],
            "pass --dataset (e.g. gsm8k, or a jsonl file)",
        )
        require(
            bool(
                self.rewards.reward_funcs
                or self.rewards.reward_model
                or self.agent.environment_factory
                or self.agent.environment
                or self.agent.agent_program
            ),
            "reward_funcs",
            "set (or reward_model, an environment_factory whose environment has get_reward, or an "
            "agent_program)",
            [],
            "a run needs a reward: set reward_funcs (e.g. accuracy format; reasoning_gym for a "
            "reasoning_gym: dataset) or reward_model",
        )
        g, batch = self.generation.num_generations, self.generation_batch_size
        require(
            batch % g == 0,
            "per_device_train_batch_size x gradient_accumulation_steps",
            f"divisible by num_generations = {g}",
            batch,
            "a prompt's group of completions stays whole within a step",
        )
        require(
            not (
                self.generation.num_infer_workers
                and (self.generation.use_vllm or self.remote.vllm_server_base_url)
            ),
            "num_infer_workers",
            "0 with use_vllm or vllm_server_base_url",
            self.generation.num_infer_workers,
            "num_infer_workers starts grpoflow's own rollout servers: leave use_vllm and "
            "vllm_server_base_url unset (for vLLM servers, start them yourself and set use_vllm: true, "
            "vllm_mode: server, vllm_server_base_url)",
        )
        if self.off_policy.async_generate:
            self._validate_async()
        if self.generation.on_policy_sampling:
            self._validate_on_policy()
        require(
            not (
                self.agent.agent_program
                and self.generation.engine_name == "vllm"
                and self.vllm.vllm_tensor_parallel_size > 1
            ),
            "vllm_tensor_parallel_size",
            "1 with agent_program",
            self.vllm.vllm_tensor_parallel_size,
            "ranks sharing a colocated vLLM engine must generate together, which an agent program's "
            "requests cannot: use one GPU per engine, or vllm_mode: server",
        )
        require(
            self.eval.metric_for_best_model is None or self.eval.during_training,
            "metric_for_best_model",
            "unset unless the run evaluates",
            self.eval.metric_for_best_model,
            "set eval_dataset and eval_strategy: steps (the best checkpoint is chosen at each evaluation)",
        )

    def to_flat_dict(self) -> dict[str, Any]:
        """All keys as one flat mapping (what a YAML recipe holds)."""
        return options.to_flat(self)

    @classmethod
    def from_flat_dict(cls, values: dict[str, Any]) -> GRPOConfig:
        """Build from flat keys (or keys nested under section names), checking every value."""
        return options.load(
            cls,
            values,
            aliases=KEY_ALIASES,
            sections=LEGACY_SECTIONS,
            hint="`grpoflow train --help` lists the keys",
        )


def load_config(path: str | Path | None, overrides: dict[str, Any] | None = None) -> GRPOConfig:
    """A YAML recipe (or none) with `overrides` applied on top."""
    values = options.flatten(GRPOConfig, options.load_yaml(path), LEGACY_SECTIONS) if path is not None else {}
    return GRPOConfig.from_flat_dict({**values, **(overrides or {})})
