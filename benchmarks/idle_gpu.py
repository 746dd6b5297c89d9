"""Where the GPU waited for the host: the gaps between a profiled step's kernels, each charged to
what the host was doing at the gap's middle (the innermost profiled event then: an operator, a
synchronisation, or the step's phase when the host ran Python alone) and to the innermost grpoflow
frame in the open operators' Python stacks (profiled `with_stack=True`).

    from idle_gpu import idle_by_host, print_idle
    with profile(activities=[CPU, CUDA], with_stack=True) as profiler:
        ...
    print_idle(idle_by_host(profiler))
"""

from __future__ import annotations

import heapq
import re
from collections import defaultdict

from torch.autograd import DeviceType

from grpoflow.phases import PROFILER_PREFIX

MIN_GAP_US = 20.0
"""Gaps shorter than this (microseconds) are a launch's latency, not waiting; not counted."""
OWN_CODE = re.compile(r"grpoflow/[\w/]+\.py\(\d+\): \w+")
"""A Python frame of grpoflow's own code, as the profiler names it."""


def kernels(events) -> list[tuple[float, float, str]]:
    """(start, end, name) of each kernel the profile holds, in start order."""
    return sorted(
        (event.time_range.start, event.time_range.end, event.name)
        for event in events
        if event.device_type == DeviceType.CUDA and not event.is_user_annotation
    )


def kernel_gaps(ran: list[tuple[float, float, str]]) -> list[tuple[float, float, str, str]]:
    """Each stretch with no kernel of `ran` (`kernels`) running, between the first and the last, of
    at least MIN_GAP_US: (start, end) microseconds, the kernel that ended last before it, the one
    after."""
    gaps, reach, before = [], None, ""
    for start, end, name in ran:
        if reach is not None and start - reach >= MIN_GAP_US:
            gaps.append((reach, start, before, name))
        if reach is None or end >= reach:
            reach, before = end, name
    return gaps


def longest_gaps(profiler, count: int = 15) -> list[tuple[float, float, str, str]]:
    """The `count` longest kernel gaps: (start from the first kernel, duration, the kernel before,
    the kernel after), microseconds."""
    ran = kernels(profiler.events())
    rows = [
        (start - ran[0][0], end - start, before[:40], after[:40])
        for start, end, before, after in kernel_gaps(ran)
    ]
    return sorted(rows, key=lambda row: -row[1])[:count]


def idle_by_host(profiler) -> dict[tuple[str, str, str], list[float]]:
    """(phase, innermost host event, innermost grpoflow frame) -> [idle microseconds, gaps], for
    every kernel gap of the profile: a sweep over the host's events in start order, keeping those
    still open at each gap's middle (the host's stack then). The frame is the innermost of
    grpoflow's own in the Python stacks the open operators recorded (`with_stack=True`)."""
    events = profiler.events()
    host = sorted(
        (event.time_range.start, event.time_range.end, event.name, tuple(getattr(event, "stack", None) or ()))
        for event in events
        if event.device_type == DeviceType.CPU
    )
    idle: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    open_events: list[tuple[float, float, str, tuple[str, ...]]] = []  # a heap by end
    index = 0
    for start, end, _, _ in kernel_gaps(kernels(events)):
        middle = (start + end) / 2
        while index < len(host) and host[index][0] <= middle:
            begin, finish, name, frames = host[index]
            heapq.heappush(open_events, (finish, begin, name, frames))
            index += 1
        while open_events and open_events[0][0] < middle:
            heapq.heappop(open_events)
        stack = sorted(open_events, key=lambda event: event[1])  # outermost first
        phases = [name[len(PROFILER_PREFIX) :] for _, _, name, _ in stack if name.startswith(PROFILER_PREFIX)]
        frames = [frame for *_, called in stack for frame in called if OWN_CODE.search(frame)]
        key = (
            phases[-1] if phases else "(no phase)",
            stack[-1][2][:60] if stack else "(nothing)",
            frames[0][-70:] if frames else "-",
        )
        idle[key][0] += end - start
        idle[key][1] += 1
    return idle


def print_idle(idle: dict[tuple[str, str, str], list[float]], rows: int = 25, profiler=None) -> None:
    """The table of GPU idle time by what the host was doing, largest first; with `profiler`, its
    longest gaps after it."""
    total = sum(value[0] for value in idle.values())
    print(f"GPU idle between kernels: {total / 1e3:.1f} ms")
    print("idle ms | gaps | phase | innermost host event | innermost grpoflow frame")
    for (phase, event, frame), (micros, count) in sorted(idle.items(), key=lambda item: -item[1][0])[:rows]:
        print(f"{micros / 1e3:.1f} | {count} | {phase} | {event} | {frame}")
    if profiler is not None:
        print("longest gaps: at ms | idle ms | kernel before | kernel after")
        for at, micros, before, after in longest_gaps(profiler):
            print(f"{at / 1e3:.1f} | {micros / 1e3:.2f} | {before} | {after}")
