"""Where the GPU waited for the host: the gaps between a profiled step's kernels, each charged to
what the host was doing at the gap's middle (the innermost profiled event then: an operator, a
synchronisation, or a Python function when profiled `with_stack=True`).

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


def kernel_gaps(events) -> list[tuple[float, float]]:
    """(start, end) microseconds of each stretch with no kernel running, between the first kernel
    and the last, of at least MIN_GAP_US."""
    spans = sorted(
        (event.time_range.start, event.time_range.end)
        for event in events
        if event.device_type == DeviceType.CUDA and not event.is_user_annotation
    )
    gaps, reach = [], None
    for start, end in spans:
        if reach is not None and start - reach >= MIN_GAP_US:
            gaps.append((reach, start))
        reach = end if reach is None else max(reach, end)
    return gaps


def idle_by_host(profiler) -> dict[tuple[str, str, str], list[float]]:
    """(phase, innermost host event, innermost grpoflow frame) -> [idle microseconds, gaps], for
    every kernel gap of the profile: a sweep over the host's events in start order, keeping those
    still open at each gap's middle (the host's stack then)."""
    events = profiler.events()
    host = sorted(
        (event.time_range.start, event.time_range.end, event.name)
        for event in events
        if event.device_type == DeviceType.CPU
    )
    idle: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0.0, 0])
    open_events: list[tuple[float, float, str]] = []  # a heap by end
    index = 0
    for start, end in kernel_gaps(events):
        middle = (start + end) / 2
        while index < len(host) and host[index][0] <= middle:
            begin, finish, name = host[index]
            heapq.heappush(open_events, (finish, begin, name))
            index += 1
        while open_events and open_events[0][0] < middle:
            heapq.heappop(open_events)
        stack = sorted(open_events, key=lambda event: event[1])  # outermost first
        phases = [name[len(PROFILER_PREFIX) :] for _, _, name in stack if name.startswith(PROFILER_PREFIX)]
        frames = [name for _, _, name in stack if OWN_CODE.search(name)]
        key = (
            phases[-1] if phases else "(no phase)",
            stack[-1][2][:60] if stack else "(nothing)",
            frames[-1][-70:] if frames else "-",
        )
        idle[key][0] += end - start
        idle[key][1] += 1
    return idle


def print_idle(idle: dict[tuple[str, str, str], list[float]], rows: int = 25) -> None:
    """The table of GPU idle time by what the host was doing, largest first."""
    total = sum(value[0] for value in idle.values())
    print(f"GPU idle between kernels: {total / 1e3:.1f} ms")
    print("idle ms | gaps | phase | innermost host event | innermost grpoflow frame")
    for (phase, event, frame), (micros, count) in sorted(idle.items(), key=lambda item: -item[1][0])[:rows]:
        print(f"{micros / 1e3:.1f} | {count} | {phase} | {event} | {frame}")
