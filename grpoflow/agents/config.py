"""The agent section: what turns a single completion into an episode of several turns, played by
grpoflow (tools, an environment) or by an agent program of the user's own (option names follow
TRL's GRPOConfig and ms-swift)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from grpoflow import imports
from grpoflow.chat.tool_calls import check_tool_call_format
from grpoflow.options import require

AGENT_PACKAGES = ("openai", "httpx", "fastapi", "uvicorn")
"""What agent programs need: the `agent` extra."""


@dataclass(kw_only=True, slots=True)
class AgentConfig:
    """Tools, environments and the limits of an episode."""

    tools: list[str] = field(default_factory=list)
    """Functions the model may call, as import paths (`pkg.module:fn`, `file.py:fn`): type hints
    and a Google-style docstring each, rendered into the prompt by the chat template (TRL's
    `tools`)."""
    environment_factory: dict[str, str] | str | None = None
    """A class (or factory) as an import path: one instance per episode, `reset(**row)` at its
    start, its public methods are tools, `get_reward()` scores it, `respond(text)` answers a turn
    that calls no tool (TRL's `environment_factory`, plus `respond`). A mapping of names to
    import paths (`a=pkg:A,b=file.py:B` on the command line) lets each row's `environment`
    column pick its class."""
    environment: str | None = None
    """Another library's environment by name, played like an environment_factory class and
    scored by its own rewards: `verifiers:TASKSET_ID` (grpoflow.tasks.verifiers_env),
    `openenv:pkg.module:Environment` (grpoflow.tasks.openenv_env), arguments as
    `?key=value&key=value`. Its rows are the run's prompts when `dataset` is unset."""
    rollout_func: str | None = None
    """A function as an import path that plays a step's rollouts itself (TRL's `rollout_func`):
    `fn(prompts, trainer)` returns a dict of `prompt_ids`, `completion_ids`, `logprobs`, optionally
    `env_mask`, and extra keys that reach the reward functions."""
    max_turns: int | None = None
    """Most policy turns per episode; unset: as many as the other limits allow."""
    max_tool_calling_iterations: int | None = None
    """Most turns whose tool calls are answered; unset: no limit (TRL)."""
    max_turn_tokens: int | None = None
    """Most tokens the policy writes in one turn; unset: the rest of max_completion_length."""
    tool_call_parser: str = "auto"
    """How tool calls are read from a turn (vLLM's names): hermes, qwen3_coder, llama3_json,
    deepseek_v3 (or deepseek_v31), mistral, openai (gpt-oss's harmony), or auto: the one the
    tokenizer's chat template renders, chosen once per run and logged (grpoflow.chat.tool_calls)."""
    environment_timeout: float = 60.0
    """Seconds a tool call, `reset`, `respond` or `get_reward` may take; past it the episode ends
    with its error recorded (a tool's error is shown to the model instead)."""
    environment_workers: int = 128
    """Threads that run synchronous tools and environment hooks at once; a call that hangs past
    environment_timeout holds one until it returns, and later calls wait for a free one (so a
    hanging environment never grows the run's thread count past this)."""
    agent_program: str | None = None
    """An agent written against the `openai` client, as an import path (`pkg.module:fn`,
    `file.py:fn`): `async def agent(client, model, row) -> float | None`, one call per episode,
    sampling from the policy through chat completions; its return value is the episode's reward
    (grpoflow.rollout.agent_programs)."""
    agent_concurrency: int = 64
    """Episodes of agent_program in flight at once, and the threads a plain (synchronous) program
    runs on: one that hangs past agent_timeout holds its thread until it returns, and later episodes
    wait for a free one within their own agent_timeout."""
    agent_timeout: float = 600.0
    """Seconds one agent_program episode may take; past it the episode ends with no reward."""
    agent_workers: int | None = None
    """Worker processes that run agent_program, each with its openai clients and its own copy of
    the hosted policy server's app (request parsing, chat templates, tokenising, episode
    recording), its engine calls sent to the training process, which keeps only the engine and its
    batcher; agent_concurrency is split between them. 0: all in the training process. Unset:
    min(4, CPU cores / 4) with an engine on a CUDA device, else 0 (`resolve_agent_workers`). Only
    for a policy the run hosts itself (not with vllm_mode server)."""

    def __post_init__(self) -> None:
        for name in ("max_turns", "max_tool_calling_iterations", "max_turn_tokens"):
            value = getattr(self, name)
            require(value is None or value >= 1, name, ">= 1 (or unset)", value)
        check_tool_call_format(self.tool_call_parser)
        if isinstance(self.environment_factory, dict):
            require(
                bool(self.environment_factory) and all(self.environment_factory),
                "environment_factory",
                "an import path, or a non-empty mapping of environment names to import paths",
                self.environment_factory,
            )
        require(
            self.environment is None or self.environment_factory is None,
            "environment",
            "unset with environment_factory",
            self.environment,
            "an episode plays one environment: keep environment (a library's, by name) or "
            "environment_factory (a class), not both",
        )
        require(
            self.rollout_func is None or not self.enabled,
            "rollout_func",
            "unset when tools or environment_factory are set",
            self.rollout_func,
            "a rollout_func plays the whole rollout: call tools and environments inside it, or drop it",
        )
        require(
            self.environment_timeout > 0, "environment_timeout", "> 0 (seconds)", self.environment_timeout
        )
        require(self.environment_workers > 0, "environment_workers", "> 0", self.environment_workers)
        require(self.agent_concurrency >= 1, "agent_concurrency", ">= 1", self.agent_concurrency)
        require(self.agent_timeout > 0, "agent_timeout", "> 0 (seconds)", self.agent_timeout)
        require(
            self.agent_workers is None or self.agent_workers >= 0,
            "agent_workers",
            ">= 0 (0: the programs run in the training process; unset: chosen from the device)",
            self.agent_workers,
        )
        require(
            self.agent_program is None or not (self.enabled or self.rollout_func),
            "agent_program",
            "unset with tools, environment_factory or rollout_func",
            self.agent_program,
            "an agent program plays its episodes itself (its tools are its own): drop tools, "
            "environment_factory and rollout_func, or drop agent_program",
        )

    def check_installed(self) -> None:
        """ValueError naming the install command when agent_program's packages are missing (the
        openai client, and the server that hosts the policy for it)."""
        if self.agent_program is not None:
            imports.require_extra(AGENT_PACKAGES, "agent", "agent_program")

    def resolve_agent_workers(self, on_cuda: bool) -> int:
        """The worker processes agent programs run in: agent_workers, or when unset
        min(4, CPU cores / 4) (at least 1) beside an engine on a CUDA device, else 0."""
        if self.agent_workers is not None:
            return self.agent_workers
        return min(4, max(1, (os.cpu_count() or 1) // 4)) if on_cuda else 0

    @property
    def enabled(self) -> bool:
        """Whether episodes run (tools or an environment are set)."""
        return bool(self.tools or self.environment_factory or self.environment)
