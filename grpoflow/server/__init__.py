"""`grpoflow serve`: a rollout server that speaks vLLM's HTTP protocol on grpoflow's engines.

`build_service(ServeConfig(model=...))` loads the model and its engine, `build_app(service)` is the
FastAPI app (app.py lists the endpoints), `serve(config)` runs it with uvicorn. The package needs
FastAPI and uvicorn (`pip install 'grpoflow[server]'`); nothing else in grpoflow imports it.
"""

from __future__ import annotations

from grpoflow.server.app import build_app
from grpoflow.server.build import build_service, serve
from grpoflow.server.settings import ServeConfig

__all__ = ["ServeConfig", "build_app", "build_service", "serve"]
