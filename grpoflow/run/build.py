"""Assemble a run from its config: each part built from its own section, checked before any
training work starts."""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from grpoflow import report
from grpoflow.agents.setup import agent_environment
from grpoflow.algo import check_packed_attention
from grpoflow.data.prompts import PromptItem
from grpoflow.distributed import DistributedContext, init_distributed
from grpoflow.engines import EngineOptions, RolloutEngine, build_engine
from grpoflow.engines.colocate import ColocateLayout
from grpoflow.learn.learner import Learner
from grpoflow.policy import batch_invariant, lora, optimizer_state, placement
from grpoflow.policy.auto_settings import ChosenSettings
from grpoflow.policy.compile_costs import CompileCostRecorder
from grpoflow.policy.compiling import trace_every_layer_alike
from grpoflow.policy.expert_parallel import expert_parameters
from grpoflow.policy.loading import load_checkpoint_weights, reference_model, resolve_device
from grpoflow.policy.offload import OptimizerOffload
from grpoflow.rewards import RewardRunner
from grpoflow.rollout.agent_programs import AgentPrograms
from grpoflow.rollout.groups import Rollout
from grpoflow.rollout.source import GroupSource
from grpoflow.run import checkpoint, infer_workers
from grpoflow.run.chosen_settings import choose_for_run, chosen_record, compile_shape, gpu_spec
from grpoflow.run.config import GRPOConfig
from grpoflow.run.evaluation import Evaluator
from grpoflow.run.health import HealthMonitor
from grpoflow.run.infer_workers import RolloutServers
from grpoflow.run.metrics import ListenerRelay, MetricsLogger, StepListener, StepLog
from grpoflow.run.output_dir import claim_output_dir
from grpoflow.run.plan_check import check_plan
from grpoflow.run.sources import build_group_source, build_rollout, on_policy_check, rollout_rewards
from grpoflow.run.trainer import GRPOTrainer

logger = logging.getLogger("grpoflow")


def build_trainer(config: GRPOConfig) -> GRPOTrainer:
    """Everything a run needs, each part built from its own section and handed to the trainer:
    prompts, rewards, policy, engine, placement, the source of groups, the learner, the services;
    the speed settings left unset chosen for the device first (`chosen_settings`)."""
    config, chosen = choose_for_run(config)
    training = config.training
    config.agent.check_installed()
    quiet_request_logs()
    seed_everything(training.seed)
    claim = claim_output_dir(
        training.output_dir, training.resume_from_checkpoint, training.overwrite_output_dir
    )
    kv_blocks = check_plan(config)  # before anything heavy loads
    settings_record = chosen_record(config, chosen, kv_blocks)
    distributed, device = init_distributed(resolve_device(config.policy.device))
    check_world(config, distributed)
    tune_device(device)
    environment_factory = agent_environment(config.agent)
    rewards = build_rewards(config, environment_factory, device)  # first: a missing package stops here
    tokenizer = config.policy.load_tokenizer()
    items = [] if config.atropos.enabled else config.data.load_prompts(tokenizer, seed=training.seed)
    model, ref_model = build_models(config, tokenizer, device, claim.resume, distributed)
    workers = infer_workers.start_for_run(config, distributed, next(model.parameters()).dtype)
    engine = build_rollout_engine(
        config, model, tokenizer, distributed, workers, kv_blocks if device.type == "cuda" else None
    )
    policy_placement, ref_placement = placement.place_models(
        model,
        ref_model,
        config.placement,
        device,
        world_size=distributed.world_size,
        engine_shares_weights=engine.shares_policy_weights,
    )
    check = on_policy_check(config, model)
    rollout, source = build_sources(
        config,
        tokenizer,
        environment_factory,
        model,
        policy_placement,
        engine,
        rewards,
        items,
        distributed,
        check,
    )
    total_steps = config.total_steps(len(items), distributed.world_size)
    steps_per_epoch = config.steps_per_epoch(len(items), distributed.world_size) if items else None
    trainer = GRPOTrainer(
        config.loop_settings(total_steps, steps_per_epoch),
        source=source,
        advantages=config.algorithm.step_advantages(
            source.reward_weights, config.generation.num_generations, distributed
        ),
        learner=build_learner(
            config,
            policy_placement,
            ref_placement,
            engine,
            distributed,
            total_steps,
            exact_draws=check == "update",
        ),
        engine=engine,
        weight_sync=config.sync.build(engine, policy_placement, items, tokenizer),
        checkpoints=training.checkpointer(policy_placement, tokenizer, distributed, claim.run_id),
        health=HealthMonitor(config.health),
        tokenizer=tokenizer,
        placement=policy_placement,
        ref_placement=ref_placement,
        distributed=distributed,
        evaluator=build_evaluator(config, rollout, rewards, engine, tokenizer, distributed),
        cleanups=run_cleanups(rollout, workers),
        observers=run_observers(config, chosen, distributed),
    )
    start(trainer, config, claim, workers, settings_record)
    return trainer


def tune_device(device: torch.device) -> None:
    """cuDNN's SDPA spends ~1 ms of CPU per call planning (measured on an H100 with torch 2.11),
    which makes training CPU-bound; flash and memory-efficient attention do not: off on CUDA."""
    if device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def build_sources(
    config: GRPOConfig,
    tokenizer,
    environment_factory,
    model: torch.nn.Module,
    policy_placement: placement.Placement,
    engine: RolloutEngine,
    rewards: RewardRunner | None,
    items: list[PromptItem],
    distributed: DistributedContext,
    check: str | None,
) -> tuple[Rollout, GroupSource]:
    """The rollout that plays a step's prompts (`check`: how on_policy_sampling's draws are
    checked, `on_policy_check`) and the source of groups around it."""
    vocab_size = model.get_input_embeddings().num_embeddings
    rollout = build_rollout(
        config, tokenizer, environment_factory, placement=policy_placement, vocab_size=vocab_size, check=check
    )
    source = build_group_source(
        config,
        rollout=rollout,
        engine=engine,
        placement=policy_placement,
        rewards=rewards,
        items=items,
        tokenizer=tokenizer,
        distributed=distributed,
        vocab_size=vocab_size,
        sleep=config.vllm.sleep_level != 0,  # as chosen_settings chose it
    )
    return rollout, source


def build_models(
    config: GRPOConfig, tokenizer, device: torch.device, resume: Path | None, distributed: DistributedContext
) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """The policy (adapters applied, a resumed run's weights loaded, the same on every rank) and
    its reference model when beta is not 0."""
    model = config.adapter.apply(
        config.policy.build(vocab_size=len(tokenizer), seed=config.training.seed, device=device)
    )
    if config.policy.torch_compile:
        trace_every_layer_alike(model)
    if config.training.padding_free:
        check_packed_attention(model)
    ref_model = reference_model(model) if config.algorithm.beta != 0 else None
    generation = config.generation
    batch_invariant.install_if_wanted(
        generation.batch_invariant,
        generation.on_policy_sampling,
        model,
        bool(config.policy.torch_compile),
        use_liger_kernel=config.policy.use_liger_kernel is True,
    )
    if resume is not None:
        load_checkpoint_weights(model, resume)
    distributed.broadcast_parameters(model)
    return model, ref_model


def build_learner(
    config: GRPOConfig,
    policy_placement: placement.Placement,
    ref_placement: placement.Placement | None,
    engine: RolloutEngine,
    distributed: DistributedContext,
    total_steps: int,
    exact_draws: bool = False,
) -> Learner:
    """The learner of the algorithm and training sections, with its optimizer over every
    optimizer step of the run; `exact_draws`: the update checks the engine's draws bit for bit
    (`on_policy_check: update`)."""
    optimizer, scheduler = build_optimizer(
        policy_placement.module,
        config,
        total_steps * config.algorithm.num_iterations,
        sharded=policy_placement.is_sharded,
        expert_group=policy_placement.expert_group,
    )
    settings = config.update_settings(
        copies_weights=not engine.shares_policy_weights, exact_draws=exact_draws
    )
    return Learner(
        policy_placement, optimizer, scheduler, settings, ref_placement=ref_placement, distributed=distributed
    )


def build_evaluator(
    config: GRPOConfig,
    rollout: Rollout,
    rewards: RewardRunner | None,
    engine: RolloutEngine,
    tokenizer,
    distributed: DistributedContext,
) -> Evaluator | None:
    """The evaluator of the eval section, sampling like the run through its rollout; None when
    there is no eval_dataset. It evaluates during training as eval_strategy and eval_on_start say,
    and whenever the Python API's `evaluate` asks."""
    if not config.eval.eval_dataset:
        return None
    if not config.eval.during_training:
        logger.warning(
            "eval_dataset is set but eval_strategy is 'no' and eval_on_start false: the run will not "
            "evaluate during training (set eval_strategy: steps, or use `grpoflow eval`)"
        )
    assert rewards is not None, "a run that evaluates has rewards (atropos_url refuses eval_dataset)"
    items = eval_prompts(config, tokenizer)
    logger.info("evaluating on %d prompts of %s", len(items), ", ".join(config.eval.eval_dataset))
    return Evaluator(
        config.eval,
        items,
        rollout=rollout,
        rewards=rewards,
        sampling=config.step_sampling(tokenizer.eos_token_id),
        distributed=distributed,
        per_prompt_seeds=engine.capabilities.per_prompt_params,
        batch_size=config.generation_batch_size,
    )


def eval_prompts(config: GRPOConfig, tokenizer, datasets: list[str] | None = None) -> list[PromptItem]:
    """The prompts of `datasets` (default: eval_dataset) in eval_split, read as the run reads its
    training prompts."""
    data = dataclasses.replace(
        config.data, dataset=datasets or config.eval.eval_dataset, dataset_split=config.eval.eval_split
    )
    return data.load_prompts(tokenizer, seed=config.training.seed)


def build_rewards(
    config: GRPOConfig, environment_factory: Callable | dict | None, device: torch.device
) -> RewardRunner | None:
    """The run's rewards with those its rollout adds (an environment's), or None under Atropos,
    whose environments score their own groups."""
    if config.atropos.enabled:
        return None
    extra = rollout_rewards(config, environment_factory)
    return RewardRunner.from_config(config.rewards, device=device, extra=extra)


def run_observers(
    config: GRPOConfig, chosen: ChosenSettings, distributed: DistributedContext
) -> list[Callable[[int, dict[str, float]], None]]:
    """A compiled run's main process records what compiling cost it, for later runs' choice
    (`compile_costs`)."""
    gpu = gpu_spec(config)
    if not config.policy.torch_compile or not distributed.is_main or gpu is None:
        return []
    return [CompileCostRecorder(compile_shape(config, chosen, gpu.name))]


def run_cleanups(rollout: Rollout, workers: RolloutServers | None) -> list[Callable[[], None]]:
    """What the run closes at its end besides its source: the agent programs' server, the
    rollout servers it started."""
    cleanups = [rollout.close] if isinstance(rollout, AgentPrograms) else []
    return cleanups + [workers.close] if workers else cleanups


def start(
    trainer: GRPOTrainer,
    config: GRPOConfig,
    claim,
    workers: RolloutServers | None,
    chosen: dict[str, dict[str, object]] | None = None,
) -> None:
    """Bring the run to its first step: the servers it started get the policy, a resumed run its
    state, and the output directory is claimed (with the `chosen` settings' record) once every
    rank has read it."""
    resume = claim.resume
    if workers and resume is None:  # the servers start from the model's files; the policy may differ
        trainer.weight_sync.send(0)
    if resume is not None:
        state = checkpoint.load_trainer_state(resume)
        checkpoint.warn_about_changes(state.get("config", {}), config.to_flat_dict())
        trainer.load_state_dict(state)
        logger.info("resumed from %s at step %d", resume, trainer.step_count)
    distributed = trainer.distributed
    distributed.barrier()  # every rank has read the directory before rank 0 changes it
    if distributed.is_main:
        claim.apply(settings=config.to_flat_dict(), chosen=chosen)
    distributed.barrier()


def quiet_request_logs() -> None:
    """Keep the HTTP client's one line per request (INFO) out of a run's log: an agent program's
    run makes thousands of requests a step. Its warnings still show."""
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(max(logging.getLogger(name).level, logging.WARNING))


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def check_world(config: GRPOConfig, distributed: DistributedContext) -> None:
    """The rules that need the number of processes, checked before any model loads."""
    if config.generation.engine_name == "vllm":
        ColocateLayout(
            rank=distributed.rank,
            world_size=distributed.world_size,
            tensor_parallel_size=config.vllm.vllm_tensor_parallel_size,
        )
    check_expert_parallel(config, distributed.world_size)
    if config.atropos.enabled and distributed.world_size > 1:
        raise ValueError(
            "atropos_url needs one training process: the API hands each batch to one trainer; run "
            "without torchrun (the environments and rollout servers may still span many GPUs)"
        )
    if config.off_policy.async_generate and config.algorithm.dynamic_sample and distributed.world_size > 1:
        raise ValueError(
            "async_generate with dynamic_sample needs one process: its resampling rounds agree across "
            "ranks through collectives, which cannot run beside the update's; turn one of them off"
        )


def check_expert_parallel(config: GRPOConfig, world_size: int) -> None:
    """expert_model_parallel_size splits the experts over every rank, for the native engine."""
    experts_over, engine = config.placement.expert_model_parallel_size, config.generation.engine_name
    if experts_over not in (1, world_size):
        raise ValueError(
            f"expert_model_parallel_size must be 1 or the number of processes ({world_size}), "
            f"got {experts_over}: expert parallelism splits the experts over every rank"
        )
    if experts_over > 1 and engine != "native":
        raise ValueError(
            f"expert_model_parallel_size must be 1 with the {engine} engine, got {experts_over}: expert "
            "parallelism needs the native engine, which reads the gathered experts in place; set "
            "rollout_engine: native, or expert_model_parallel_size: 1"
        )


def build_rollout_engine(
    config: GRPOConfig,
    model: torch.nn.Module,
    tokenizer,
    distributed: DistributedContext,
    workers: RolloutServers | None,
    kv_blocks: int | None = None,
) -> RolloutEngine:
    """The engine the generation section chooses, around the policy (or the run's servers);
    `kv_blocks`: the native engine's KV-cache blocks, as the memory plan sized them."""
    engine = config.generation.engine
    if kv_blocks is not None and config.generation.engine_name == "native":
        from grpoflow.engines.native.sizing import NativeEngineConfig

        engine = dataclasses.replace(NativeEngineConfig.sized_as(engine), num_kv_blocks=kv_blocks)
    remote = config.remote
    if workers is not None:
        remote = dataclasses.replace(remote, vllm_server_base_url=",".join(workers.urls))
    options = EngineOptions(
        engine=dataclasses.replace(engine, max_model_len=engine.max_model_len or config.max_model_len),
        logprob_chunk_size=config.algorithm.logprob_chunk_size,
        vllm=config.vllm,
        remote=remote,
        exclusive_servers=workers is not None,
        seed=config.training.seed,
        rank=distributed.rank,
        world_size=distributed.world_size,
        distribution_positions=config.generation.distribution_check_positions,
        record_routing=config.algorithm.moe.replays_recorded(batch_invariant.installed(model)),
        batch_invariant=batch_invariant.installed(model),
    )
    try:
        built = build_engine(config.generation.engine_name, lora.generation_model(model), tokenizer, options)
    except Exception:
        if workers:
            workers.check_alive()  # a server that died says why
            workers.close()
        raise
    if config.placement.expert_model_parallel_size > 1 and getattr(built, "path", None) != "family":
        raise ValueError(
            "expert_model_parallel_size needs the native engine's family path (the generic path would run "
            "the split experts' exchanges while generating), but this model runs on the generic path "
            "(the log says why): set expert_model_parallel_size: 1"
        )
    if options.distribution_positions and not built.capabilities.distributions:
        logger.info(
            "distribution_check_positions: the %s engine does not return whole next-token distributions, so "
            "the engine/trainer distribution check is off (no sampling/distribution_* metrics)",
            built.capabilities.name,
        )
    return built


def build_optimizer(
    model: torch.nn.Module,
    config: GRPOConfig,
    optimizer_steps: int,
    *,
    sharded: bool = False,
    expert_group=None,
):
    """AdamW over the trainable parameters and the learning-rate schedule over `optimizer_steps`;
    a sharded model's optimizer state (each rank's experts' too, split over `expert_group`) saves
    and loads in full, and the state moves to the CPU between steps under offload_optimizer.
    Expert-parallel experts (plain tensors beside FSDP's DTensors) form a parameter group of
    their own: a foreach or fused step takes one kind of tensor at a time."""
    training, layout = config.training, config.placement
    from transformers import get_scheduler

    experts = expert_parameters(model) if expert_group is not None else []
    own = {id(parameter) for parameter in experts}
    trained = [p for p in model.parameters() if p.requires_grad and id(p) not in own]
    optimizer = torch.optim.AdamW(
        [{"params": params} for params in (trained, [p for p in experts if p.requires_grad]) if params],
        lr=training.learning_rate,
        betas=(training.adam_beta1, training.adam_beta2),
        weight_decay=training.weight_decay,
        fused=training.optim == "adamw_torch_fused",
    )
    scheduler = get_scheduler(
        training.lr_scheduler_type,
        optimizer,
        num_warmup_steps=training.warmup(optimizer_steps),
        num_training_steps=optimizer_steps,
    )
    if sharded:
        optimizer_state.full_optimizer_state(optimizer, experts, expert_group)
    if layout.offload_optimizer:
        OptimizerOffload(optimizer, gc_collect=layout.gc_collect_after_offload)
    return optimizer, scheduler


def run(
    config: GRPOConfig, trainer: GRPOTrainer | None = None, listener: StepListener | None = None
) -> list[dict[str, float]]:
    """Train (building the trainer unless given); the metrics of every step. `listener` follows
    the steps on every rank (as rank 0 logs the metrics, averaged over ranks)."""
    trainer = trainer or build_trainer(config)
    metrics_logger: StepLog | None = None
    interrupted, is_main = False, trainer.distributed.is_main
    if not is_main and listener is not None:
        metrics_logger = ListenerRelay(listener)
    if is_main:  # rank 0 logs the metrics averaged over ranks
        metrics_logger = MetricsLogger(
            config.training.output_dir,
            report_to=[sink for sink in config.log.report_to if sink != "none"],
            total_steps=trainer.total_steps,
            start_step=trainer.step_count,
            show_progress=not config.log.disable_tqdm,
            run_config=trainer.settings.flat_config,  # the settings chosen for the device in place
            listener=listener,
        )
    try:
        return trainer.train(metrics_logger)
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        if metrics_logger is not None:
            metrics_logger.close()
        trainer.close()
        # Finished, or stopped early (a health check, failing rewards), the run gets its report;
        # not when the user interrupts it (`grpoflow report OUTPUT_DIR` writes it then).
        if is_main and config.log.html_report and not interrupted:
            report.write_at_end(config.training.output_dir)
