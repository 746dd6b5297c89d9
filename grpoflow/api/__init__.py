"""The Python API in TRL's shape: a TRL user's GRPO script runs with its import changed to
`from grpoflow import GRPOConfig, GRPOTrainer`.

    args = GRPOConfig(output_dir="out", learning_rate=1e-6, num_generations=8, max_steps=100)
    trainer = GRPOTrainer(model="Qwen/Qwen2-0.5B-Instruct", reward_funcs=reward_len, args=args,
                          train_dataset=dataset)
    trainer.train()
    trainer.save_model("out/final")
"""

from grpoflow.api.config import GRPOConfig
from grpoflow.api.trainer import GRPOTrainer

__all__ = ["GRPOConfig", "GRPOTrainer"]
