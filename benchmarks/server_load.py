"""`grpoflow serve` under load and abuse, on the CPU: many concurrent completions while clients
send hanging weight-transfer inits, a chat-template bomb, a 10M-character prompt, disconnect
mid-request and update the weights; /health is probed throughout.

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
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

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


async def load(url: str, args: argparse.Namespace, weights: Path, pid: int) -> dict:
    limits = httpx.Limits(max_connections=args.requests + 100, max_keepalive_connections=args.requests + 100)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        health: list[float] = []
        peak = [rss_mib(pid)]
        done = threading.Event()

        def probe() -> None:
            """/health from a thread and a connection of its own, so the load's own client loop
            does not delay the probes."""
            with httpx.Client(base_url=url, timeout=30) as own:
                while not done.is_set():
                    start = time.perf_counter()
                    own.get("/health")
                    health.append(time.perf_counter() - start)
                    peak.append(rss_mib(pid))
                    time.sleep(0.1)

        def completion(index: int):
            body = {"prompt": [1 + index % 50, 2, 3], "max_tokens": args.max_tokens, "seed": index}
            return timed(client, "POST", "/v1/completions", json=body)

        async def disconnecting(index: int) -> tuple[int, float]:
            body = {"prompt": [4, 5, 6], "n": 64, "max_tokens": 256, "ignore_eos": True}
            return await timed(client, "POST", "/v1/completions", json=body, timeout=0.05)

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
        hostile = [
            *(timed(client, "POST", "/init_weight_transfer_engine", json=init) for _ in range(10)),
            timed(
                client,
                "POST",
                "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "hi"}],
                    "chat_template": BOMB,
                    "max_tokens": 1,
                },
            ),
            timed(client, "POST", "/v1/completions", json={"prompt": "x" * 10_000_000}),
            *(disconnecting(index) for index in range(args.disconnects)),
        ]

        async def updates() -> list[int]:
            statuses = []
            for _ in range(args.updates):
                statuses.append((await timed(client, "POST", "/start_weight_update", json={}))[0])
                body = {"update_info": {"weights_path": str(weights)}}
                statuses.append((await timed(client, "POST", "/update_weights", json=body))[0])
                statuses.append((await timed(client, "POST", "/finish_weight_update", json={}))[0])
                await asyncio.sleep(0.2)
            return statuses

        prober = threading.Thread(target=probe, daemon=True)
        prober.start()
        start = time.perf_counter()
        hostile_tasks = [asyncio.ensure_future(task) for task in hostile]
        update_task = asyncio.ensure_future(updates())
        results = await asyncio.gather(*(completion(index) for index in range(args.requests)))
        load_seconds = time.perf_counter() - start
        update_statuses = await update_task
        done.set()
        prober.join()
        hostile_results = [task.result() for task in hostile_tasks if task.done()]
        for task in hostile_tasks:
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
        "hostile_statuses": sorted(status for status, _ in hostile_results),
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
    parser.add_argument("--output", default=None, help="JSON path (default benchmarks/results/...)")
    args = parser.parse_args()

    port = free_port()
    with tempfile.TemporaryDirectory() as scratch:
        weights = Path(scratch) / "model.safetensors"
        server = start_server(port, Path(scratch) / "serve.log")
        try:
            url = f"http://127.0.0.1:{port}"
            info = httpx.get(url + "/server_info", params={"config_format": "json"}).json()
            vocab_size = info["vllm_config"]["model_config"]["vocab_size"]  # the tiny model's shape
            model = build_preset_model("tiny", vocab_size, seed=DEFAULT_SEED)
            save_file({name: p.detach().contiguous() for name, p in model.named_parameters()}, str(weights))
            for _ in range(20):  # warm up
                httpx.post(url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=60)
            before = rss_mib(server.pid)
            figures = asyncio.run(load(url, args, weights, server.pid))
            time.sleep(2.0)
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
    figures.update(
        {
            "rss_before_mib": before,
            "rss_after_mib": after,
            "rss_after_over_before": after / before,
            "healthy_after": alive,
            "stopped_on_sigterm": stopped,
            "cpus": os.cpu_count(),
        }
    )
    rows = [
        ("completions succeeded", f"{figures['succeeded']} / {figures['requests']}"),
        ("latency p50 / p99", f"{figures['p50_s']:.2f} s / {figures['p99_s']:.2f} s"),
        ("load wall time", f"{figures['load_seconds']:.1f} s"),
        ("/health max (probes)", f"{figures['health_max_s'] * 1000:.0f} ms ({figures['health_probes']})"),
        ("hostile requests' statuses", " ".join(map(str, figures["hostile_statuses"])) or "-"),
        ("weight updates' statuses", " ".join(map(str, figures["update_statuses"]))),
        ("RSS before / peak / after", f"{before:.0f} / {figures['rss_peak_mib']:.0f} / {after:.0f} MiB"),
        ("after / before", f"{figures['rss_after_over_before']:.3f}"),
        ("stopped on SIGTERM", str(stopped)),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    today = datetime.date.today().isoformat()
    path = (
        Path(args.output)
        if args.output
        else Path(__file__).parent / "results" / f"{today}-server-load-cpu.json"
    )
    path.write_text(json.dumps(figures, indent=2) + "\n")
    print(f"results in {path}")


if __name__ == "__main__":
    main()
