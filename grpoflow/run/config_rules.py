"""The rules of a run's configuration that span its sections for one way of running: Atropos
environments, on-policy sampling, asynchronous generation. `GRPOConfig` takes them from
`SpanningRules` and applies them in `validate`."""

from __future__ import annotations

from grpoflow.options import require


class SpanningRules:
    """`GRPOConfig`'s rules for Atropos, on-policy sampling and asynchronous generation; they read
    its sections (generation, agent, atropos, off_policy, algorithm, training, adapter, ...)."""

    __slots__ = ()

    def _validate_atropos(self) -> None:
        """Atropos environments bring the prompts, the sampling and the scores; the run trains and
        sends its weights to the rollout server the environments sample from."""
        require(
            self.generation.engine_name == "vllm_server",
            "atropos_url",
            "used with a rollout server (use_vllm: true, vllm_mode: server)",
            self.atropos.atropos_url,
            "Atropos environments sample from a server the trainer sends its weights to: start "
            "`grpoflow serve --model M --port 9000`, point the environments at http://HOST:9000/v1 and "
            "set use_vllm: true, vllm_mode: server, vllm_server_base_url: http://HOST:9000",
        )
        require(
            self.training.max_steps > 0,
            "max_steps",
            "> 0 with atropos_url",
            self.training.max_steps,
            "an Atropos run has no dataset to count epochs over: set max_steps (registered with the API "
            "as num_steps)",
        )
        clashes = {
            "async_generate": self.off_policy.async_generate,
            "dynamic_sample": self.algorithm.dynamic_sample,
            "tools / environment_factory": self.agent.enabled,
            "rollout_func": self.agent.rollout_func is not None,
            "agent_program": bool(self.agent.agent_program),
            "dataset": bool(self.data.dataset),
            "reward_funcs / reward_model": bool(self.rewards.reward_funcs or self.rewards.reward_model),
            "eval_dataset": bool(self.eval.eval_dataset),
        }
        for name, used in clashes.items():
            require(
                not used,
                name,
                "unset with atropos_url",
                used,
                "Atropos environments choose the prompts, sample and score: drop it, or drop atropos_url",
            )

    def _validate_on_policy(self) -> None:
        """The trainer replays the native engine's draws of completions and environment episodes'
        turns; an agent program's turns only the update's check can verify."""
        generation = self.generation
        engine = generation.engine_name
        require(
            engine == "native",
            "on_policy_sampling",
            f"false with the {engine} engine",
            True,
            "on_policy_sampling replays the native engine's keyed draws: use rollout_engine: native "
            "without use_vllm",
        )
        clashes = {
            "rollout_func": (
                self.agent.rollout_func is not None,
                "a rollout function returns completions and log-probs of its own making, which the trainer "
                "can neither redraw nor tell apart from the policy's draws",
            ),
            "atropos_url": (
                bool(self.atropos.atropos_url),
                "Atropos environments sample on their own server",
            ),
            "repetition_penalty != 1": (
                self.generation.sampling.repetition_penalty != 1,
                "the trainer's forward does not apply a repetition penalty",
            ),
            "replay_sampling_truncation: false": (
                not self.algorithm.replay_sampling_truncation,
                "the trainer must draw from the truncated distribution the engine draws from",
            ),
            "routing_replay: true": (
                self.algorithm.moe.routing_replay is True,
                "each token is then the trainer's own draw through its own routers, or under the update's "
                "check the engine's draw through routers that are the trainer's bit for bit (batch_invariant), "
                "so no engine routing is left to replay (routing_replay: auto leaves it off)",
            ),
            "lora_dropout > 0": (
                self.adapter.train_type == "lora" and self.adapter.lora_dropout > 0,
                "dropout makes the update's forward random, so no draw can match it (lora_dropout: 0 keeps LoRA)",
            ),
        }
        for name, (used, why) in clashes.items():
            require(
                not used,
                "on_policy_sampling",
                f"false with {name}",
                True,
                f"on_policy_sampling replays the native engine's draws on the trainer's forward, and {why}: "
                "drop one of the two",
            )
        require(
            not self.agent.agent_program
            or (
                generation.on_policy_check != "replay"
                and generation.batch_invariant is not False
                and not generation.sampling.truncation.active
            ),
            "on_policy_check",
            "update (or auto with batch_invariant: true) with agent_program",
            generation.on_policy_check,
            "an agent program's turns arrive over HTTP after it has acted on them, too late to redraw: "
            "set on_policy_check: update and batch_invariant: true (no top_k/top_p/min_p), whose check "
            "needs no redraw",
        )

    def _validate_async(self) -> None:
        engine = self.generation.engine_name
        require(
            engine == "vllm_server",
            "async_generate",
            f"false with the {engine} engine, which runs in the training process",
            True,
            "async_generate needs a rollout server to generate while the policy trains: set use_vllm: "
            "true and vllm_mode: server (e.g. against `grpoflow serve`)",
        )
        interval, staleness = self.sync.weight_sync_interval, self.off_policy.max_staleness
        require(
            interval <= staleness,
            "max_staleness",
            f">= weight_sync_interval ({interval}) under async_generate",
            staleness,
            f"async_generate with weight_sync_interval={interval} samples batches up to {interval} policy "
            f"versions old: raise max_staleness (now {staleness}) to at least {interval}",
        )
