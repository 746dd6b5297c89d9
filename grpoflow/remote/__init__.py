"""The client of rollout servers: `RemoteEngine` drives vLLM OpenAI-compatible servers (vLLM's own
or `grpoflow serve`) over HTTP, from what each server offers (`capabilities`) and, for vLLM's own
server, a LoRA policy's adapters loaded at run time (`runtime_adapters`). Registered as the
`vllm_server` engine in `grpoflow.engines`."""
