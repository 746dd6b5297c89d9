"""The policy in a verifiers environment's seat: grpoflow plays the one agent of a verifiers
`Env`, whose `run(task, agents)` decides what is said between the policy's turns.

`Env.run` talks to its agent through `agents.<seat>.interaction(task)` and `turn(message)` (or
`agents.<seat>.run(task)`, one turn); here each `turn` hands its message to the episode and waits
for the policy's reply, which grpoflow samples with the rest of the batch. The environment's code
runs unchanged, so a multi-turn environment (a user it scripts, a game it referees) answers the
policy exactly as it would answer any agent. It runs on one event loop of its own, in a daemon
thread (`seat_loop`), so an episode a limit ended is wound down at once, whatever grpoflow's own
loops are doing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import threading
from collections.abc import AsyncIterator, Coroutine
from typing import Any

END = object()
"""What the seat's queue holds once `Env.run` has returned."""


@functools.cache
def seat_loop() -> asyncio.AbstractEventLoop:
    """The event loop every seat and `Env.run` runs on: one per process, in a daemon thread."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="grpoflow-verifiers", daemon=True).start()
    return loop


def on_seat_loop(coroutine: Coroutine) -> concurrent.futures.Future:
    """Run `coroutine` on the seat loop; its future, to wait on from any thread."""
    return asyncio.run_coroutine_threadsafe(coroutine, seat_loop())


class PolicySeat:
    """One episode's link between `Env.run` and the policy: `Env.run` awaits `turn`, grpoflow
    awaits `next_message`, then `answer` with each reply, and `close` once the episode ended.
    Every method runs on the seat loop."""

    def __init__(self, segment_type: type, assistant_type: type) -> None:
        self.segment_type, self.assistant_type = segment_type, assistant_type
        self.events: asyncio.Queue = asyncio.Queue()
        self.pending: asyncio.Future | None = None
        self.error: BaseException | None = None
        self.closed = False

    async def turn(self, message: Any = None) -> Any:
        """`Interaction.turn`: the message goes to the episode, the policy's reply comes back."""
        if self.closed:
            raise RuntimeError("the episode has ended: its last turn came back terminated")
        self.pending = asyncio.get_running_loop().create_future()
        await self.events.put(None if message is None else message_text(message))
        text = await self.pending
        if text is None:  # the episode ended (a turn or token limit) before the policy replied
            return self.segment_type(messages=[], terminated=True)
        return self.segment_type(messages=[self.assistant_type(content=text)], root_reply=text)

    async def next_message(self) -> Any:
        """The environment's next message (None: the policy goes on unprompted), or END."""
        event = await self.events.get()
        if self.error is not None:
            raise self.error
        return event

    async def answer(self, text: str) -> Any:
        """The policy's reply to the pending turn; the environment's next message, or END."""
        if self.pending is not None and not self.pending.done():
            self.pending.set_result(text)
        return await self.next_message()

    async def close(self) -> None:
        """End the exchange: a turn still waiting comes back terminated, and later ones raise."""
        self.closed = True
        if self.pending is not None and not self.pending.done():
            self.pending.set_result(None)

    async def drive(self, env: Any, task: Any, agents: Any) -> None:
        """`Env.setup` then `Env.run` over `agents`, then END (or the error it raised)."""
        try:
            await env.setup(agents)
            await env.run(task, agents)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            self.error = error
        await self.events.put(END)


class PolicyAgent:
    """`agents.<seat>` for the seat the policy plays (attributes set on it, like `trainable`,
    are kept and ignored)."""

    def __init__(self, seat: PolicySeat) -> None:
        self._seat = seat

    @contextlib.asynccontextmanager
    async def interaction(self, task: Any, **kwargs: Any) -> AsyncIterator[PolicyAgent]:
        yield self

    async def turn(self, message: Any = None) -> Any:
        return await self._seat.turn(message)

    async def run(self, task: Any, **kwargs: Any) -> None:
        """One exchange: the task's prompt, the policy's answer."""
        await self._seat.turn(None)


class PolicyAgents:
    """`Env.run`'s `agents` with the one seat the environment declares."""

    def __init__(self, seat_name: str, agent: PolicyAgent) -> None:
        self._seat_name, self._agent = seat_name, agent

    def __getattr__(self, name: str) -> PolicyAgent:
        if name.startswith("_"):
            raise AttributeError(name)
        if name != self._seat_name:
            raise ValueError(
                f"the environment asked for agent {name!r}; grpoflow plays its one seat "
                f"{self._seat_name!r} with the policy and has no model for other seats"
            )
        return self._agent


def message_text(message: Any) -> str:
    """A turn's message as text: a string, a verifiers message, or a list of them."""
    if isinstance(message, str):
        return message
    if isinstance(message, list):
        return "\n".join(message_text(item) for item in message)
    content = getattr(message, "content", message)
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(str(getattr(part, "text", None) or "") for part in content)
