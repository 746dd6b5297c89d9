"""A LoRA policy's adapters on vLLM's own OpenAI server, through its runtime LoRA loading.

A server started with `--enable-lora` (and `--max-lora-rank` at least the policy's rank) and
`VLLM_ALLOW_RUNTIME_LORA_UPDATING=1` loads a PEFT adapter directory by path
(`POST /v1/load_lora_adapter`) and serves it under a name of its own, which completion requests
give as their `model`. After the first sync (the base, unmerged, through the checkpoint transport)
each sync writes the adapters beside the checkpoints, on the filesystem the servers share with the
trainer (as the checkpoint transport needs), loads them under a name new at each version, points
generation at that name and unloads the previous one: megabytes per sync instead of the model. A
new name rather than `load_inplace` under the old one, so that vLLM's prefix cache, which keys
blocks by the adapter, never serves blocks computed with an older version. Names carry a token of
the engine's own, so a resumed run or another trainer on the same server never meets a name it
did not load; a retried sync of the same version reloads it in place (the same weights).
"""

from __future__ import annotations

import logging
import secrets
import shutil
from pathlib import Path

import torch

from grpoflow.engines.vllm_adapters import write_peft_adapter
from grpoflow.transport import ServerError, WeightSyncError
from grpoflow.transport.server_client import ServerClient

logger = logging.getLogger("grpoflow.remote")

LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
NAME = "grpoflow-{token}-v{version}"
"""The name a version's adapter is served under."""


def runtime_lora_rank(client: ServerClient, url: str, info: dict | None) -> int | None:
    """The largest adapter rank vLLM's own server at `url` loads at run time (its `lora_config`'s
    max_lora_rank), or None: no /server_info (dev mode), no `--enable-lora`, or no runtime loading
    (`VLLM_ALLOW_RUNTIME_LORA_UPDATING`, without which the load route answers 404)."""
    lora = ((info or {}).get("vllm_config") or {}).get("lora_config")
    rank = lora.get("max_lora_rank") if isinstance(lora, dict) else None
    if not isinstance(rank, int):
        return None
    try:
        client.request("POST", url, LOAD, json={})  # no fields: refused, unless the route is missing
    except ServerError as error:
        return None if error.status in (404, 405, None) else rank
    return rank


class ServerAdapters:
    """The adapter every server generates with: its directory under `root` and its served name
    (None: generate with the base)."""

    def __init__(self, client: ServerClient, root: Path, timeout: float) -> None:
        self.client, self.root, self.timeout = client, root, timeout
        self.token = secrets.token_hex(4)
        self.name: str | None = None
        self.directory: Path | None = None

    def load(self, adapters: dict[str, tuple[torch.Tensor, torch.Tensor]], version: int) -> None:
        """Write `adapters` ({module: (A, B scaled)}) for `version`, have every server load them
        under the version's name, and drop the previous version."""
        name = NAME.format(token=self.token, version=version)
        directory = self.root / f"adapter-{self.token}-v{version}"
        write_peft_adapter(directory, adapters)
        body = {"lora_name": name, "lora_path": str(directory), "load_inplace": True}
        try:
            self.client.map(lambda url: self._call(url, LOAD, body))
        except ServerError as error:
            if directory != self.directory:
                shutil.rmtree(directory, ignore_errors=True)
            raise WeightSyncError(
                f"loading the LoRA adapters failed: {error}. The servers need --enable-lora, "
                f"--max-lora-rank at least the policy's lora_rank, VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, "
                f"and {self.root} readable at the same path"
            ) from error
        if name != self.name:
            self._drop()
        self.name, self.directory = name, directory

    def clear(self) -> None:
        """Generate with the base again (the weights arrived merged)."""
        self._drop()
        self.name = self.directory = None

    def _drop(self) -> None:
        """Unload the current version (best effort: a server that fails to keeps a stale adapter
        nobody asks for) and remove its directory."""
        if self.name is not None:
            body = {"lora_name": self.name}
            try:
                self.client.map(lambda url: self._call(url, UNLOAD, body, missing_ok=True))
            except ServerError as error:
                logger.warning("unloading LoRA adapter %s failed: %s", self.name, error)
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)

    def _call(self, url: str, path: str, body: dict, missing_ok: bool = False) -> None:
        try:
            self.client.request("POST", url, path, json=body, timeout=self.timeout, text=True)
        except ServerError as error:
            if not (missing_ok and error.status == 404):
                raise

    def close(self) -> None:
        if self.directory is not None:
            shutil.rmtree(self.directory, ignore_errors=True)
