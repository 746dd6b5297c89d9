"""Assemble a run from its config: each part built from its own section, checked before any
training work starts."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import random
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from grpoflow import imports
from grpoflow.agents.atropos_client import AtroposClient
from grpoflow.agents.setup import build_episode_runner, environment_rewards, load_environment_factory
from grpoflow.distributed import DistributedContext, init_distributed
from grpoflow.engines import EngineOptions, RolloutEngine, build_engine
from grpoflow.engines.colocate import ColocateLayout
from grpoflow.engines.remote_client import API_KEY_ENV
from grpoflow.learn.update import replayed_truncation
from grpoflow.policy import lora, placement
from grpoflow.policy.loading import load_checkpoint_weights, reference_model, resolve_device
from grpoflow.policy.offload import OptimizerOffload
from grpoflow.rewards import RewardRunner
from grpoflow.rollout.agent_programs import AgentPrograms, program_rewards
from grpoflow.rollout.atropos import AtroposBatches
from grpoflow.rollout.groups import Episodes, Rollout, SingleTurn
from grpoflow.rollout.on_policy import OnPolicySingleTurn
from grpoflow.rollout.rollout_func import RolloutFunction
from grpoflow.run import checkpoint, infer_workers, report
from grpoflow.run.config import GRPOConfig
from grpoflow.run.evaluation import Evaluator
from grpoflow.run.infer_workers import RolloutServers
from grpoflow.run.metrics import MetricsLogger
from grpoflow.run.output_dir import claim_output_dir
from grpoflow.run.plan_check import check_plan
from grpoflow.run.trainer import GRPOTrainer

logger = logging.getLogger("grpoflow")


def build_trainer(config: GRPOConfig) -> GRPOTrainer:
    """Everything a run needs: prompts, rewards, policy, engine, placement, optimizer, trainer."""
    training = config.training
    seed_everything(training.seed)
    claim = claim_output_dir(
        training.output_dir, training.resume_from_checkpoint, training.overwrite_output_dir
    )
    resume = claim.resume
    kv_blocks = check_plan(config)  # before anything heavy loads
    distributed, device = init_distributed(resolve_device(config.policy.device))
    check_world(config, distributed)
    if device.type != "cuda":
        kv_blocks = None
    if device.type == "cuda":
        # cuDNN's SDPA spends ~1 ms of CPU per call planning (measured on an H100 with torch
        # 2.11), which makes training CPU-bound; flash and memory-efficient attention do not.
        torch.backends.cuda.enable_cudnn_sdp(False)
    atropos = config.atropos.enabled
    environment_factory = load_environment_factory(config.agent.environment_factory)
    rewards = (
        None
        if atropos
        else RewardRunner.from_config(  # first: a missing package stops here
            config.rewards, device=device, extra=rollout_rewards(config, environment_factory)
        )
    )
    tokenizer = config.policy.load_tokenizer()
    rollout = build_rollout(config, tokenizer, environment_factory)
    items = [] if atropos else config.data.load_prompts(tokenizer, seed=training.seed)
    model = config.adapter.apply(
        config.policy.build(vocab_size=len(tokenizer), seed=training.seed, device=device)
    )
    if isinstance(rollout, RolloutFunction):  # its ids may use every embedding row, not only the tokenizer's
        rollout.vocab_size = model.get_input_embeddings().num_embeddings
    ref_model = reference_model(model) if config.algorithm.beta != 0 else None
    if resume is not None:
        load_checkpoint_weights(model, resume)
    distributed.broadcast_parameters(model)
    workers = infer_workers.start_for_run(config, distributed, next(model.parameters()).dtype)
    engine = build_rollout_engine(config, model, tokenizer, distributed, workers, kv_blocks)
    policy_placement, ref_placement = placement.place_models(
        model,
        ref_model,
        config.placement,
        device,
        world_size=distributed.world_size,
        engine_shares_weights=engine.shares_policy_weights,
    )
    if config.generation.on_policy_sampling:
        rollout = OnPolicySingleTurn(
            tokenizer,
            policy_placement,
            micro_batch_size=config.training.per_device_train_batch_size,
            temperature=config.generation.sampling.temperature,
            truncation=replayed_truncation(config.generation.sampling, config.algorithm),
            chunk_size=config.algorithm.logprob_chunk_size,
        )
    steps = config.total_steps(len(items), distributed.world_size)
    optimizer, scheduler = build_optimizer(
        model, config, steps * config.algorithm.num_iterations, sharded=policy_placement.is_sharded
    )
    trainer = GRPOTrainer(
        config,
        tokenizer=tokenizer,
        engine=engine,
        rewards=rewards,
        items=items,
        optimizer=optimizer,
        scheduler=scheduler,
        placement=policy_placement,
        ref_placement=ref_placement,
        distributed=distributed,
        per_prompt_seeds=config.generation.engine_name == "native",
        run_id=claim.run_id,
        rollout=rollout,
        batches=atropos_batches(config, tokenizer) if atropos else None,
    )
    if isinstance(rollout, AgentPrograms):
        trainer.add_cleanup(rollout.close)
    if workers:
        trainer.add_cleanup(workers.close)
        if resume is None:  # the servers start from the model's files; the policy may differ
            engine.update_weights(policy_placement.rollout_weights(engine), 0)
    if resume is not None:
        state = checkpoint.load_trainer_state(resume)
        checkpoint.warn_about_changes(state.get("config", {}), config.to_flat_dict())
        trainer.load_state_dict(state)
        logger.info("resumed from %s at step %d", resume, trainer.step_count)
    if config.eval.during_training:
        trainer.evaluator = build_evaluator(config, trainer, tokenizer)
    elif config.eval.eval_dataset:
        logger.warning(
            "eval_dataset is set but eval_strategy is 'no' and eval_on_start false: the run will not "
            "evaluate (set eval_strategy: steps, or use `grpoflow eval`)"
        )
    if trainer.batches is not None:
        trainer.batches.register(trainer.total_steps, trainer.step_count)
    distributed.barrier()  # every rank has read the directory before rank 0 changes it
    if distributed.is_main:
        claim.apply(settings=config.to_flat_dict())
    distributed.barrier()
    return trainer


def build_rollout(
    config: GRPOConfig, tokenizer, environment_factory: Callable[[], Any] | Mapping | None
) -> Rollout:
    """What turns a step's prompts into groups: the user's rollout_func when one is named, an agent
    program's episodes, episodes of tools or an environment, else one sampled completion per
    group member."""
    agent = config.agent
    if agent.rollout_func is not None:
        return RolloutFunction(
            imports.load_object(agent.rollout_func, "rollout_func"),
            tokenizer,
            SimpleNamespace(**config.to_flat_dict()),
            per_prompt_params=config.generation.engine_name == "native",
        )
    if agent.agent_program is not None:
        return AgentPrograms(
            agent,
            tokenizer,
            model_name=config.policy.model,
            max_model_len=config.generation.engine.max_model_len or config.max_model_len,
            tool_call_parser=agent.tool_call_parser,
            server_api_key=config.remote.vllm_server_api_key or os.environ.get(API_KEY_ENV),
        )
    runner = build_episode_runner(
        config.agent,
        tokenizer,
        environment_factory,
        max_completion_length=config.generation.max_completion_length,
        max_prompt_length=config.data.max_prompt_length,
        system=config.data.system,
        per_prompt_params=config.generation.engine_name == "native",
    )
    return Episodes(runner, tokenizer) if runner is not None else SingleTurn(tokenizer)


def rollout_rewards(
    config: GRPOConfig, environment_factory: Callable[[], Any] | Mapping | None
) -> list[tuple[str, Callable[..., Any]]]:
    """Rewards the rollout brings beside reward_funcs: an environment's `get_reward`, what an
    agent program returns."""
    extra = environment_rewards(environment_factory)
    return extra + program_rewards() if config.agent.agent_program is not None else extra


def build_evaluator(config: GRPOConfig, trainer: GRPOTrainer, tokenizer) -> Evaluator:
    """The evaluator of the eval section, sampling like the trainer through its rollout."""
    data = dataclasses.replace(
        config.data, dataset=config.eval.eval_dataset, dataset_split=config.eval.eval_split
    )
    items = data.load_prompts(tokenizer, seed=config.training.seed)
    logger.info("evaluating on %d prompts of %s", len(items), ", ".join(config.eval.eval_dataset))
    return Evaluator(
        config.eval,
        items,
        rollout=trainer.rollout,
        rewards=trainer.rewards,
        sampling=trainer.sampling,
        distributed=trainer.distributed,
        per_prompt_seeds=trainer.draws.per_prompt_seeds,
        batch_size=config.generation_batch_size,
    )


def atropos_batches(config: GRPOConfig, tokenizer) -> AtroposBatches:
    """The run's source of scored groups on Atropos's trajectory API (registered once built)."""
    settings = config.atropos
    size = settings.atropos_batch_size or config.generation_batch_size
    client = AtroposClient(dataclasses.replace(settings, atropos_batch_size=size))
    return AtroposBatches(client, tokenizer)


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
    )
    try:
        return build_engine(config.generation.engine_name, lora.generation_model(model), tokenizer, options)
    except Exception:
        if workers:
            workers.check_alive()  # a server that died says why
            workers.close()
        raise


def build_optimizer(
    model: torch.nn.Module, config: GRPOConfig, optimizer_steps: int, *, sharded: bool = False
):
    """AdamW over the trainable parameters and the learning-rate schedule over `optimizer_steps`;
    a sharded model's optimizer state saves and loads in full, and the state moves to the CPU
    between steps under offload_optimizer."""
    training, layout = config.training, config.placement
    from transformers import get_scheduler

    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=training.learning_rate,
        betas=(training.adam_beta1, training.adam_beta2),
        weight_decay=training.weight_decay,
        fused=training.optim == "adamw_torch_fused",
    )
    scheduler = get_scheduler(
        training.lr_scheduler_type,
        optimizer,
        num_warmup_steps=math.ceil(training.warmup_ratio * optimizer_steps),
        num_training_steps=optimizer_steps,
    )
    if sharded:
        placement.full_optimizer_state(optimizer)
    if layout.offload_optimizer:
        OptimizerOffload(optimizer, gc_collect=layout.gc_collect_after_offload)
    return optimizer, scheduler


def run(config: GRPOConfig, trainer: GRPOTrainer | None = None) -> list[dict[str, float]]:
    """Train (building the trainer unless given); the metrics of every step."""
    trainer = trainer or build_trainer(config)
    metrics_logger, interrupted = None, False
    if trainer.distributed.is_main:  # rank 0 logs the metrics averaged over ranks
        metrics_logger = MetricsLogger(
            config.training.output_dir,
            report_to=[sink for sink in config.log.report_to if sink != "none"],
            total_steps=trainer.total_steps,
            start_step=trainer.step_count,
            show_progress=not config.log.disable_tqdm,
            run_config=config.to_flat_dict(),
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
        if metrics_logger is not None and config.log.html_report and not interrupted:
            report.write_at_end(config.training.output_dir)
