"""A verifiers taskset for the tiny model, loaded by name (`verifiers:vf-letters`): echo the letter
the prompt names. Two weighted rewards score a reply: the share of its first eight characters equal
to the letter (weight 1) and whether it is at most eight characters long (weight 0.5)."""

from __future__ import annotations

import verifiers.v1 as vf

LETTERS = "abcdefgh"


class LettersData(vf.TaskData):
    letter: str


class LettersConfig(vf.TasksetConfig):
    num_tasks: int = 16


class LettersTask(vf.Task[LettersData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def echoed(self, task: LettersData, trace: vf.Trace) -> float:
        reply = trace.root_reply or ""
        return sum(char == task.letter for char in reply[:8]) / 8

    @vf.reward(weight=0.5)
    async def short(self, trace: vf.Trace) -> float:
        return float(len(trace.root_reply or "") <= 8)


class LettersTaskset(vf.Taskset[LettersTask, LettersConfig]):
    def load(self):
        for index in range(self.config.num_tasks):
            letter = LETTERS[index % len(LETTERS)]
            yield LettersTask(LettersData(prompt=f"echo {letter}:", letter=letter), self.config.task)


__all__ = ["LettersTaskset"]
