"""A multi-turn verifiers environment for the tiny model (`verifiers:vf-relay`): its `run` names a
new letter after each of the agent's turns, three letters in all, and the task's reward is the mean
share of each reply's first four characters equal to its letter."""

from __future__ import annotations

import verifiers.v1 as vf

TURNS = ("a", "c", "e")


class RelayTask(vf.Task[vf.TaskData, vf.State, vf.TaskConfig]):
    @vf.reward
    async def relayed(self, trace: vf.Trace) -> float:
        replies = [m.content or "" for m in trace.messages if m.role == "assistant"]
        scores = [sum(c == letter for c in reply[:4]) / 4 for reply, letter in zip(replies, TURNS)]
        return sum(scores) / len(TURNS)


class RelayTaskset(vf.Taskset[RelayTask, vf.TasksetConfig]):
    def load(self):
        for _ in range(8):
            yield RelayTask(vf.TaskData(prompt=f"echo {TURNS[0]}:"), self.config.task)


class RelayEnv(vf.Env[vf.SingleAgentEnvConfig]):
    async def run(self, task, agents):
        async with agents.agent.interaction(task) as exchange:
            segment = await exchange.turn()
            for letter in TURNS[1:]:
                if segment.terminated:
                    return
                segment = await exchange.turn(f"echo {letter}:")


__all__ = ["RelayEnv", "RelayTaskset"]
