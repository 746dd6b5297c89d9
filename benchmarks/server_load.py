"""`grpoflow serve` under load and abuse, on the CPU: many concurrent completions and weight
updates, run twice on one server, first alone and then while clients send hanging weight-transfer
inits, 8 chat-template bombs, a 10M-character prompt, 4 chat_template_kwargs of 3M keys, 8 token-id
bodies of 60 MB, a request for 1,000 x 200 tokens, an episode of 150 turns carrying 3 MiB of tools
each, malformed fields and weights holding 1e38, and disconnect mid-request; /health is probed
throughout. The figures to hold: every completion succeeds, p99 with the faults within 1.5x of p99
without, /health under 0.5 s, and the server's memory back within 10% after.

    python benchmarks/server_load.py                    # 1,000 concurrent requests
    python benchmarks/server_load.py --requests 100     # a quicker look

The server runs as a process of its own (`grpoflow serve --model tiny --device cpu
--trust-request-chat-template`, so the template bomb is rendered rather than refused), so its
resident memory is read from /proc before the load, at its peak and after it. Prints a table and
saves the figures as JSON under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from safetensors.torch import save_file

from grpoflow.policy.tiny import DEFAULT_SEED, build_preset_model

BOMB = "{% for i in range(99999) %}{% for j in range(3000) %}{% endfor %}{% endfor %}x"
"""A 3e8-iteration template within the sandbox's range limit (each range under 100,000)."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def start_server(port: int, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "grpoflow", "serve", "--model", "tiny", "--device", "cpu"]
    command += ["--port", str(port), "--trust-request-chat-template", "--hold-lease-s", "30"]
    process = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"the server did not start:\n{log.read_text()[-2000:]}")


async def timed(client: httpx.AsyncClient, method: str, path: str, **kwargs) -> tuple[int, float]:
    start = time.perf_counter()
    try:
        response = await client.request(method, path, **kwargs)
        return response.status_code, time.perf_counter() - start
    except httpx.HTTPError:
        return -1, time.perf_counter() - start


FAULTS = (
    "inits",
    "template_bombs",
    "long_prompt",
    "disconnects",
    "kwargs_bombs",
    "token_bodies",
    "huge_request",
    "bad_fields",
    "episode_bomb",
    "huge_weights",
)


def hostile_requests(client: httpx.AsyncClient, args: argparse.Namespace) -> list[tuple[str, Any]]:
    """The faults `args.faults` names, sent alongside the load: (name, coroutine giving (status, s))."""
    init = {
        "init_info": {
            "backend": "gloo",
            "master_address": "127.0.0.1",
            "master_port": free_port(),
            "rank_offset": 1,
            "world_size": 2,
            "timeout": 1e9,
        }
    }
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    big = {"prompt": [7, 8, 9], "n": 1000, "max_tokens": 200, "ignore_eos": True}
    headers = {"Content-Type": "application/json"}

    def post(path: str, times: int = 1, **kwargs) -> list:
        return [timed(client, "POST", path, **kwargs) for _ in range(times)]

    makers = {
        "inits": lambda: post("/init_weight_transfer_engine", 10, json=init),
        "template_bombs": lambda: post("/v1/chat/completions", 8, json={**chat, "chat_template": BOMB}),
        "long_prompt": lambda: post("/v1/completions", json={"prompt": "x" * 10_000_000}),
        "disconnects": lambda: [disconnecting(client) for _ in range(args.disconnects)],
        "kwargs_bombs": lambda: post(
            "/v1/chat/completions", 4, content=kwargs_bomb_body(args.kwargs_bomb_keys), headers=headers
        ),
        "token_bodies": lambda: post(
            "/generate", 8, content=token_id_body(args.token_body_mb), headers=headers
        ),
        "huge_request": lambda: post("/v1/completions", json=big),
        "bad_fields": lambda: [
            *post("/v1/completions", json={"prompt": [1], "repetition_penalty": 1e-300}),
            *post("/v1/completions", json={"prompt": [1], "n": "3"}),
        ],
        "episode_bomb": lambda: [episode_bomb(client, args.episode_turns)],
    }
    return [(name, request) for name in args.faults if name in makers for request in makers[name]()]


async def disconnecting(client: httpx.AsyncClient) -> tuple[int, float]:
    body = {"prompt": [4, 5, 6], "n": 64, "max_tokens": 256, "ignore_eos": True}
    return await timed(client, "POST", "/v1/completions", json=body, timeout=0.05)


def kwargs_bomb_body(keys: int) -> bytes:
    """A chat request whose chat_template_kwargs hold `keys` keys (3M: about 40 MB)."""
    pairs = ",".join(f'"k{index}":{index}' for index in range(keys))
    head = '{"messages":[{"role":"user","content":"hi"}],"max_tokens":1,"chat_template_kwargs":{'
    return (head + pairs + "}}").encode()


def token_id_body(megabytes: float) -> bytes:
    """A /generate body of about `megabytes` MB of prompt token ids."""
    ids = ",".join(["1"] * int(megabytes * 1e6 / 2))
    return ('{"prompt":{"prompt_token_ids":[' + ids + ']},"max_tokens":1}').encode()


async def episode_bomb(client: httpx.AsyncClient, turns: int) -> tuple[int, float]:
    """`turns` chat turns of one episode, each carrying 3 MiB of tool schemas, then a read of it:
    the status of the first turn refused (or of the read when none is)."""
    start = time.perf_counter()
    tool = {"type": "function", "function": {"name": "f", "description": "d" * (3 << 20)}}
    headers = {"X-Episode-Id": f"bomb-{os.getpid()}"}
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [tool], "max_tokens": 1}
    body["chat_template"] = "{% for m in messages %}{{ m.content }}{% endfor %}"  # ignores tools
    for _ in range(turns):
        status, _ = await timed(client, "POST", "/v1/chat/completions", json=body, headers=headers)
        if status != 200:
            return status, time.perf_counter() - start
    status, _ = await timed(client, "GET", f"/v1/episodes/{headers['X-Episode-Id']}")
    await timed(client, "DELETE", f"/v1/episodes/{headers['X-Episode-Id']}")
    return status, time.perf_counter() - start


class Prober:
    """/health probed every 0.1 s, and the server's resident memory read, from a process of its
    own: the load's client keeps this process's interpreter busy, and a probe waiting for it here
    would time the client rather than the server."""

    def __init__(self, url: str, pid: int) -> None:
        context = multiprocessing.get_context("spawn")
        self._stop, ready = context.Event(), context.Event()
        self._results, sending = context.Pipe(duplex=False)
        arguments = (url, pid, ready, self._stop, sending)
        self._process = context.Process(target=probe, args=arguments, daemon=True)
        self._process.start()
        if not ready.wait(120):
            raise RuntimeError("the /health prober did not start")

    def stop(self) -> tuple[list[float], list[float]]:
        """Stop probing: the /health latencies (s) and the resident memory read at each (MiB)."""
        self._stop.set()
        health, peak = self._results.recv()
        self._process.join()
        return health, peak


def probe(url: str, pid: int, ready: Any, stop: Any, results: Any) -> None:
    health: list[float] = []
    peak = [rss_mib(pid)]
    with httpx.Client(base_url=url, timeout=30) as own:
        own.get("/health")  # connected: the load may start
        ready.set()
        while not stop.is_set():
            start = time.perf_counter()
            own.get("/health")
            health.append(time.perf_counter() - start)
            peak.append(rss_mib(pid))
            time.sleep(0.1)
    results.send((health, peak))


async def load(url: str, args: argparse.Namespace, files: dict[str, Path], pid: int, *, faults: bool) -> dict:
    """`args.requests` concurrent completions and `args.updates` weight updates, with the faults
    alongside when `faults`; /health is probed from a process of its own throughout."""
    limits = httpx.Limits(max_connections=args.requests + 200, max_keepalive_connections=args.requests + 200)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        prober = Prober(url, pid)

        def completion(index: int):
            body = {"prompt": [1 + index % 50, 2, 3], "max_tokens": args.max_tokens, "seed": index}
            return timed(client, "POST", "/v1/completions", json=body)

        async def updates() -> list[int]:
            """Weight updates from a file; with faults, every other one carries a huge finite
            weight and must be refused whole."""
            statuses = []
            for index in range(args.updates * (2 if faults else 1)):
                huge = faults and "huge_weights" in args.faults and index % 2
                path = files["faulty" if huge else "weights"]
                statuses.append((await timed(client, "POST", "/start_weight_update", json={}))[0])
                body = {"update_info": {"weights_path": str(path)}}
                statuses.append((await timed(client, "POST", "/update_weights", json=body))[0])
                statuses.append((await timed(client, "POST", "/finish_weight_update", json={}))[0])
                await asyncio.sleep(0.2)
            return statuses

        start = time.perf_counter()
        hostile = hostile_requests(client, args) if faults else []
        hostile_tasks = [(name, asyncio.ensure_future(task)) for name, task in hostile]
        update_task = asyncio.ensure_future(updates())
        results = await asyncio.gather(*(completion(index) for index in range(args.requests)))
        load_seconds = time.perf_counter() - start
        update_statuses = await update_task
        if hostile_tasks:  # /health is still probed while the faults finish
            await asyncio.wait([task for _, task in hostile_tasks], timeout=args.fault_wait_s)
        health, peak = prober.stop()
        hostile_results: dict[str, list[int | str]] = {}
        for name, task in hostile_tasks:
            hostile_results.setdefault(name, []).append(task.result()[0] if task.done() else "unfinished")
        for _, task in hostile_tasks:
            task.cancel()
    latencies = sorted(seconds for status, seconds in results if status == 200)
    return {
        "requests": args.requests,
        "succeeded": sum(status == 200 for status, _ in results),
        "p50_s": statistics.median(latencies) if latencies else None,
        "p99_s": latencies[int(0.99 * (len(latencies) - 1))] if latencies else None,
        "load_seconds": load_seconds,
        "health_probes": len(health),
        "health_max_s": max(health) if health else None,
        "hostile_statuses": hostile_results,
        "update_statuses": update_statuses,
        "rss_peak_mib": max(peak),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--disconnects", type=int, default=20)
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--kwargs-bomb-keys", type=int, default=3_000_000)
    parser.add_argument("--token-body-mb", type=float, default=60.0)
    parser.add_argument("--episode-turns", type=int, default=150)
    parser.add_argument(
        "--faults",
        default=",".join(FAULTS),
        type=lambda text: text.split(","),
        help="which faults (default: all)",
    )
    parser.add_argument("--fault-wait-s", type=float, default=180.0, help="wait for the faults' answers")
    parser.add_argument("--server-log", default=None, help="keep the server's log here")
    parser.add_argument("--output", default=None, help="JSON path (default benchmarks/results/...)")
    args = parser.parse_args()

    port = free_port()
    with tempfile.TemporaryDirectory() as scratch:
        files = {"weights": Path(scratch) / "model.safetensors", "faulty": Path(scratch) / "huge.safetensors"}
        server = start_server(port, Path(args.server_log or Path(scratch) / "serve.log"))
        try:
            url = f"http://127.0.0.1:{port}"
            write_weights(url, files)
            for _ in range(20):  # warm up
                httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=60)
            time.sleep(5.0)  # memory is read 5 s after work, before the load as after it
            before = rss_mib(server.pid)
            clean = asyncio.run(load(url, args, files, server.pid, faults=False))
            faulted = asyncio.run(load(url, args, files, server.pid, faults=True))
            time.sleep(5.0)
            after = rss_mib(server.pid)
            alive = httpx.get(url + "/health", timeout=5).status_code == 200
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
                stopped = True
            except subprocess.TimeoutExpired:
                server.kill()
                stopped = False
    figures = {
        "without_faults": clean,
        "with_faults": faulted,
        "p99_with_over_without": faulted["p99_s"] / clean["p99_s"],
        "rss_before_mib": before,
        "rss_after_mib": after,
        "rss_after_over_before": after / before,
        "healthy_after": alive,
        "stopped_on_sigterm": stopped,
        "cpus": len(os.sched_getaffinity(0)),
        "args": vars(args),
    }
    print_table(figures)
    today = datetime.date.today().isoformat()
    path = (
        Path(args.output)
        if args.output
        else Path(__file__).parent / "results" / f"{today}-server-load-cpu.json"
    )
    path.write_text(json.dumps(figures, indent=2) + "\n")
    print(f"results in {path}")


def write_weights(url: str, files: dict[str, Path]) -> None:
    """The served model's own weights, and a copy whose first layer holds one 1e38 (finite in
    float32, far beyond any trained weight)."""
    info = httpx.get(url + "/server_info", params={"config_format": "json"}).json()
    vocab_size = info["vllm_config"]["model_config"]["vocab_size"]  # the tiny model's shape
    model = build_preset_model("tiny", vocab_size, seed=DEFAULT_SEED)
    tensors = {name: p.detach().contiguous() for name, p in model.named_parameters()}
    save_file(tensors, str(files["weights"]))
    name = next(name for name in tensors if "layers.0" in name and name.endswith("weight"))
    huge = tensors[name].clone()
    huge.view(-1)[0] = 1e38
    save_file({**tensors, name: huge}, str(files["faulty"]))


def print_table(figures: dict) -> None:
    clean, faulted = figures["without_faults"], figures["with_faults"]

    def both(make) -> str:
        return f"{make(clean):>22}  {make(faulted):>22}"

    rows = [
        ("", f"{'without faults':>22}  {'with faults':>22}"),
        ("completions succeeded", both(lambda f: f"{f['succeeded']} / {f['requests']}")),
        ("latency p50 / p99 (s)", both(lambda f: f"{f['p50_s']:.2f} / {f['p99_s']:.2f}")),
        ("load wall time (s)", both(lambda f: f"{f['load_seconds']:.1f}")),
        ("/health max ms (probes)", both(lambda f: f"{f['health_max_s'] * 1000:.0f} ({f['health_probes']})")),
        ("RSS peak (MiB)", both(lambda f: f"{f['rss_peak_mib']:.0f}")),
        ("p99 with / without", f"{figures['p99_with_over_without']:.2f}"),
        ("fault statuses", ""),
        *(
            (f"  {name}", " ".join(map(str, sorted(statuses, key=str))))
            for name, statuses in faulted["hostile_statuses"].items()
        ),
        ("update statuses", " ".join(map(str, faulted["update_statuses"]))),
        ("RSS before / after (MiB)", f"{figures['rss_before_mib']:.0f} / {figures['rss_after_mib']:.0f}"),
        ("after / before", f"{figures['rss_after_over_before']:.3f}"),
        ("healthy after, stopped on SIGTERM", f"{figures['healthy_after']}, {figures['stopped_on_sigterm']}"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")


if __name__ == "__main__":
    main()
