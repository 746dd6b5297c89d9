"""A verifiers environment with two agent seats (`verifiers:vf-pair`), which grpoflow refuses."""

from __future__ import annotations

import verifiers.v1 as vf


class PairConfig(vf.EnvConfig):
    first: vf.AgentConfig = vf.AgentConfig()
    second: vf.AgentConfig = vf.AgentConfig()


class PairTaskset(vf.Taskset[vf.Task, vf.TasksetConfig]):
    def load(self):
        yield vf.Task(vf.TaskData(prompt="hi"), self.config.task)


class PairEnv(vf.Env[PairConfig]):
    async def run(self, task, agents):
        await agents.first.run(task)


__all__ = ["PairEnv", "PairTaskset"]
