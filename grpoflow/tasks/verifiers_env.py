"""verifiers environments by name: `--environment verifiers:TASKSET_ID` (arguments as
`?key=value`, fields of the taskset's config) loads the environment as verifiers does
(`load_environment`: the taskset's own `Env`, else its single-agent env); its tasks are the
prompts, the policy plays the environment's agent seat, and the task's weighted `@vf.reward`
functions score each episode (the `VerifiersEnvironment` reward: their weighted sum).

A single-agent environment is one turn per episode; an environment whose `run` speaks to its agent
over several turns (`interaction(task)`, `turn(message)`) is played turn by turn, its messages
between the policy's turns (grpoflow.tasks.verifiers_seat). Tasks run no tool servers and no
harness program: the policy answers in text. An endless taskset gives its first MAX_TASKS tasks.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
from typing import Any

from grpoflow.tasks.library import LibrarySpec, import_library
from grpoflow.tasks.verifiers_seat import (
    END,
    PolicyAgent,
    PolicyAgents,
    PolicySeat,
    message_text,
    on_seat_loop,
)

LIBRARY = "verifiers"
MAX_TASKS = 100_000
"""Tasks read from an endless taskset."""


@functools.cache
def load(spec: LibrarySpec) -> tuple[Any, list[Any], str]:
    """The environment a spec names, its tasks and its agent seat, loaded once per process."""
    vf = import_library("verifiers.v1", "verifiers", f"environment {spec.text!r}")
    agent_configs = import_library("verifiers.v1.configs.agent", "verifiers", f"environment {spec.text!r}")
    try:
        config = vf.resolve_env_config({"taskset": {"id": spec.name, **spec.args}})
        env = vf.load_environment(config)
        tasks = list(itertools.islice(env.taskset, MAX_TASKS))
    except Exception as error:
        raise ValueError(
            f"environment {spec.text!r}: verifiers could not load it: {_one_line(error)}"
        ) from None
    seats = list(agent_configs.agent_config_fields(env.config))
    if len(seats) != 1:
        raise ValueError(
            f"environment {spec.text!r} has the agent seats {', '.join(seats)}; grpoflow trains an "
            "environment with one seat (the policy's)"
        )
    if not tasks:
        raise ValueError(f"environment {spec.text!r}: its taskset gave no tasks")
    return env, tasks, seats[0]


def load_rows(spec: LibrarySpec, split: str, seed: int) -> list[dict]:
    """One row per task: its prompt (with its system prompt) and its place in the taskset."""
    _, tasks, _ = load(spec)
    rows = []
    for index, task in enumerate(tasks):
        data = task.data
        if data.prompt is None:
            raise ValueError(
                f"environment {spec.text!r}: task {index} has no prompt; grpoflow starts each episode "
                "from the task's prompt"
            )
        prompt: str | list[dict] = (
            data.prompt if isinstance(data.prompt, str) else [_message(item) for item in data.prompt]
        )
        if data.system_prompt:
            user = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            prompt = [{"role": "system", "content": data.system_prompt}, *user]
        rows.append({"prompt": prompt, "verifiers_task": index})
    return rows


def environment_class(spec: LibrarySpec) -> type:
    """The episode class of one environment: `VerifiersEnvironment` bound to it."""
    load(spec)
    return type("VerifiersEnvironment", (VerifiersEnvironment,), {"spec": spec})


class VerifiersEnvironment:
    """One episode of a verifiers environment, in grpoflow's environment protocol: `reset`
    starts `Env.run` with the policy in its seat, `respond` passes each reply to it and returns
    its next message, `get_reward` scores the transcript with the task's rewards."""

    spec: LibrarySpec

    async def reset(self, verifiers_task: int, prompt: Any = None, **row: Any) -> str | None:
        env, tasks, seat = load(self.spec)
        vf = import_library("verifiers.v1", "verifiers", f"environment {self.spec.text!r}")
        self.task = tasks[verifiers_task]
        self.messages: list[dict] = []
        self.seat = PolicySeat(vf.Segment, vf.AssistantMessage)
        agents = PolicyAgents(seat, PolicyAgent(self.seat))
        self.driver = on_seat_loop(self.seat.drive(env, self.task, agents))
        opening = await asyncio.wrap_future(on_seat_loop(self.seat.next_message()))
        if opening is END:
            raise ValueError(f"{type(env).__name__}.run ended before the policy's first turn")
        if opening:
            self.messages.append({"role": "user", "content": opening})
        return f"\n{opening}" if opening else None

    async def respond(self, text: str) -> str | None:
        """The policy's reply, given to the environment; its next message, or None at the end."""
        self.messages.append({"role": "assistant", "content": text})
        message = await asyncio.wrap_future(on_seat_loop(self.seat.answer(text)))
        if message is END:
            return None
        self.messages.append({"role": "user", "content": message or ""})
        return message or ""

    def get_reward(self) -> float | None:
        """The weighted sum of the task's rewards over the episode's transcript (the policy's
        turns and the environment's messages)."""
        on_seat_loop(self.seat.close())  # a limit may have ended the episode mid-exchange
        return on_seat_loop(self._score()).result()

    async def _score(self) -> float | None:
        vf = import_library("verifiers.v1", "verifiers", f"environment {self.spec.text!r}")
        data = self.task.data
        conversation = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
        if isinstance(data.prompt, str):
            conversation.append({"role": "user", "content": data.prompt})
        elif data.prompt is not None:
            conversation += [_message(item) for item in data.prompt]
        conversation += self.messages
        nodes = [
            vf.MessageNode(
                parent=index - 1 if index else None,
                message=_verifiers_message(vf, item),
                sampled=item["role"] == "assistant",
            )
            for index, item in enumerate(conversation)
        ]
        trace = vf.Trace(
            task=vf.TraceTask(
                type=type(self.task).__name__, data=data, key=self.task.key, hash=self.task.hash
            ),
            agent=vf.AgentInfo(config=vf.AgentConfig()),
            nodes=nodes,
            root_reply=next(
                (m["content"] for m in reversed(self.messages) if m["role"] == "assistant"), None
            ),
            is_completed=True,
            ok=True,
        )
        await self.task.score(trace)
        if not trace.rewards or any(reward is None for reward in trace.rewards.values()):
            return None
        return trace.reward


def _one_line(error: Exception) -> str:
    lines = [line.strip() for line in str(error).splitlines()]
    return "; ".join(line for line in lines if line and not line.startswith("For further information"))


def _message(message: Any) -> dict:
    return {"role": getattr(message, "role", "user"), "content": message_text(message)}


def _verifiers_message(vf: Any, message: dict) -> Any:
    kinds = {"system": vf.SystemMessage, "user": vf.UserMessage, "assistant": vf.AssistantMessage}
    return kinds[message["role"]](content=message["content"])
