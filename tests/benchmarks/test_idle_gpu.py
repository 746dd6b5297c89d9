"""benchmarks/idle_gpu.py charges the gaps between kernels to what the host was doing (CPU: a
profile's events built by hand, as torch.profiler gives them)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

from torch.autograd import DeviceType

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import idle_gpu  # noqa: E402

WAIT = ["grpoflow/engines/native/engine.py(271): _run_steps", "grpoflow/run/trainer.py(200): step"]


def event(start: float, end: float, name: str, on_gpu: bool = False, stack=None) -> SimpleNamespace:
    return SimpleNamespace(
        time_range=SimpleNamespace(start=start, end=end),
        name=name,
        device_type=DeviceType.CUDA if on_gpu else DeviceType.CPU,
        is_user_annotation=False,
        stack=stack,
    )


PROFILE = SimpleNamespace(
    events=lambda: [
        event(0, 1000, idle_gpu.PROFILER_PREFIX + "rollout"),
        event(140, 310, "aten::item", stack=WAIT),
        event(150, 300, "cudaStreamSynchronize"),
        event(0, 120, "first", on_gpu=True),
        event(350, 500, "second", on_gpu=True),
        event(505, 600, "third", on_gpu=True),  # 5 us after the second: a launch, not a gap
        event(700, 710, "fourth", on_gpu=True),
    ]
)


def test_each_gap_goes_to_the_innermost_host_event_and_grpoflow_frame_open_at_its_middle():
    idle = idle_gpu.idle_by_host(PROFILE)
    assert dict(idle) == {
        ("rollout", "cudaStreamSynchronize", WAIT[0]): [230.0, 1],
        ("rollout", "phase/rollout", "-"): [100.0, 1],
    }


def test_the_longest_gaps_come_first_with_the_kernels_around_them(capsys):
    assert idle_gpu.longest_gaps(PROFILE) == [
        (120.0, 230.0, "first", "second"),
        (600.0, 100.0, "third", "fourth"),
    ]
    idle_gpu.print_idle(idle_gpu.idle_by_host(PROFILE), profiler=PROFILE)
    printed = capsys.readouterr().out
    assert (
        "GPU idle between kernels: 0.3 ms" in printed
        and "0.2 | 1 | rollout | cudaStreamSynchronize" in printed
    )
