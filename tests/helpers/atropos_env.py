"""A tiny Atropos environment for the tests: the model must answer with a given letter.

It is written with atroposlib's `BaseEnv` and samples through atroposlib's own server classes
(`ServerManager.managed_server` over `VLLMServer`, which calls `/generate` and `/health`), so it
talks to `grpoflow serve` exactly as Atropos's environments talk to vLLM. Run it with atroposlib's
command line:

    python tests/helpers/atropos_env.py serve --env.rollout_server_url http://127.0.0.1:8000 \\
        --env.tokenizer_name DIR --openai.base_url http://127.0.0.1:PORT/v1 --openai.tokenizer_name DIR
"""

from __future__ import annotations

import itertools

from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataGroup

LETTERS = "abcd"
PROMPT = "Say {letter}: "
GROUP_SIZE = 4
MAX_TOKENS = 6


def letter_score(completion: str, letter: str) -> float:
    """1 when the completion starts with `letter`, less the further its first character is from
    it (so a random model's groups still spread), 0 for an empty completion."""
    if not completion:
        return 0.0
    return 1.0 / (1 + abs(ord(completion[0]) - ord(letter)))


class LetterEnv(BaseEnv):
    """Prompts `Say X: ` for X in LETTERS in turn; scores each completion with letter_score."""

    name = "letter"

    @classmethod
    def config_init(cls) -> tuple[BaseEnvConfig, list[APIServerConfig]]:
        env = BaseEnvConfig(
            group_size=GROUP_SIZE,
            use_wandb=False,
            max_token_length=64,
            max_num_workers_per_node=2,
            steps_per_eval=0,
            ensure_scores_are_not_same=False,
            total_steps=1000,
            wandb_name=cls.name,
        )
        server = APIServerConfig(server_type="vllm", model_name="tiny", api_key="none", timeout=60)
        return env, [server]

    async def setup(self) -> None:
        self.letters = itertools.cycle(LETTERS)

    async def get_next_item(self) -> str:
        return next(self.letters)

    async def collect_trajectories(self, item: str) -> tuple[ScoredDataGroup, list]:
        prompt = PROMPT.format(letter=item)
        async with self.server.managed_server(tokenizer=self.tokenizer) as managed:
            await managed.completion(prompt=prompt, n=GROUP_SIZE, max_tokens=MAX_TOKENS, temperature=1.0)
            nodes = managed.get_state()["nodes"]
        group = ScoredDataGroup(tokens=[], masks=[], scores=[], inference_logprobs=[])
        for node in nodes:
            completion = [token for token, mask in zip(node.tokens, node.masked_tokens) if mask != -100]
            text = self.tokenizer.decode(completion, skip_special_tokens=True)
            group["tokens"].append(node.tokens)
            group["masks"].append(node.masked_tokens)
            group["inference_logprobs"].append(node.logprobs)
            group["scores"].append(letter_score(text, item))
        return group, []

    async def evaluate(self, *args, **kwargs) -> None:
        return None


if __name__ == "__main__":
    LetterEnv.cli()
