"""TRL's documented GRPO scripts (a reward model, tools, a rollout function, an environment) with
only the import changed, on the tiny local model on the CPU; and grpoflow's API beside TRL's own."""

from __future__ import annotations

import dataclasses
import inspect
import math
import subprocess
import sys

import pytest
from datasets import Dataset
from helpers.support import clean_env, save_reward_model
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from grpoflow import GRPOConfig, GRPOTrainer
from grpoflow.agents import generate_rollout_completions
from grpoflow.api.rewards import is_reward_model_id
from grpoflow.imports import PROVIDED
from grpoflow.policy.tiny import save_tiny_checkpoint

TRL_ARGS = dict(
    learning_rate=1e-3,
    per_device_train_batch_size=4,
    num_generations=2,
    max_completion_length=4,
    max_steps=2,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    use_cpu=True,
    bf16=False,
    seed=0,
)
"""GRPOConfig fields as a TRL script sets them (each one TRL's GRPOConfig takes)."""

TOOLS_TEMPLATE = (
    "{%- if tools %}<|system|>tools:{% for t in tools %} {{ t.function.name }}{% endfor %}<eos>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|assistant|>{{ m.content }}"
    "{%- if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }}</tool_call>{% endfor %}{% endif %}"
    "{{ '<eos>\n' }}"
    "{%- else %}<|{{ m.role }}|>{{ m.content }}{{ '<eos>\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|>{%- endif %}"
)
"""A chat template that renders the tools it is given (the one the episode tests use)."""


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    directory = save_tiny_checkpoint(tmp_path_factory.mktemp("chat_model"))
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.chat_template = TOOLS_TEMPLATE
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory):
    return save_reward_model(tmp_path_factory.mktemp("reward_model"))


def args_for(tmp_path, **changes) -> GRPOConfig:
    return GRPOConfig(output_dir=str(tmp_path / "out"), html_report=False, **{**TRL_ARGS, **changes})


def chat_dataset() -> Dataset:
    prompts = [[{"role": "user", "content": f"{a} times {b}?"}] for a, b in ((3, 4), (2, 5))]
    return Dataset.from_dict({"prompt": prompts, "answer": ["12", "10"]})


def reward_len(completions, **kwargs):
    return [-abs(4 - len(str(completion))) for completion in completions]


def test_a_loaded_reward_model_with_its_tokenizer_scores_the_run(tmp_path, tiny_model_dir, reward_model_dir):
    reward_model = AutoModelForSequenceClassification.from_pretrained(reward_model_dir, num_labels=1)
    reward_tokenizer = AutoTokenizer.from_pretrained(reward_model_dir)
    dataset = Dataset.from_dict({"prompt": ["ab", "cd", "ef", "gh"]})
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=[reward_model, reward_len],
        reward_processing_classes=[reward_tokenizer, None],
        args=args_for(tmp_path, reward_weights=[0.5, 2.0]),
        train_dataset=dataset,
    )
    trainer.train()

    written = tmp_path / "out" / "reward_model_0"
    assert trainer.config.rewards.reward_model == str(written)
    assert (written / "tokenizer.json").is_file() and (written / "model.safetensors").is_file()
    assert trainer.config.rewards.reward_weights == [2.0, 0.5]  # TRL's order, turned into the run's
    assert trainer.state.global_step == 2
    assert math.isfinite(trainer.state.log_history[-1]["rewards/reward_model/mean"])


def test_reward_model_ids_directories_and_several_models(tmp_path, tiny_model_dir, reward_model_dir):
    assert is_reward_model_id("Skywork/Skywork-Reward-V2-Qwen3-0.6B") and is_reward_model_id(reward_model_dir)
    assert not any(map(is_reward_model_id, ["accuracy", "pkg.rewards:fn", "rewards.py:fn", "pkg.rewards.fn"]))
    second = AutoModelForSequenceClassification.from_pretrained(reward_model_dir, num_labels=1)
    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=[reward_model_dir, "accuracy", second, reward_len],
        args=args_for(tmp_path, reward_weights=[1.0, 2.0, 3.0, 4.0], max_steps=1),
        train_dataset=Dataset.from_dict({"prompt": ["ab", "cd"], "solution": ["a", "c"]}),
    )
    rewards = trainer.config.rewards
    assert rewards.reward_funcs == ["accuracy", "reward_len"]
    assert rewards.reward_model == [reward_model_dir, str(tmp_path / "out" / "reward_model_2")]
    assert rewards.reward_weights == [2.0, 4.0, 1.0, 3.0]
    trainer.train()
    names = {key.split("/")[1] for key in trainer.state.log_history[-1] if key.startswith("rewards/")}
    assert {"accuracy", "reward_len", reward_model_dir.rstrip("/").split("/")[-1], "reward_model_2"} <= names

    hub = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs="Org/reward-v2.1",
        args=args_for(tmp_path / "hub"),
        train_dataset="echo",
    )
    assert (hub.config.rewards.reward_model, hub.config.rewards.reward_funcs) == ("Org/reward-v2.1", [])


def test_bad_reward_models_and_tokenizers_are_refused_by_name(tmp_path, tiny_model_dir, reward_model_dir):
    config = AutoConfig.from_pretrained(reward_model_dir, num_labels=2)
    two_labels = AutoModelForSequenceClassification.from_config(config)
    with pytest.raises(ValueError, match=r"reward_funcs\[0\].*num_labels=2.*num_labels=1"):
        GRPOTrainer(model=tiny_model_dir, reward_funcs=[two_labels], args=args_for(tmp_path))
    with pytest.raises(ValueError, match="reward_processing_classes has 2 entries for 1 reward_funcs"):
        GRPOTrainer(
            model=tiny_model_dir,
            reward_funcs=reward_len,
            reward_processing_classes=[None, None],
            args=args_for(tmp_path),
        )
    with pytest.raises(ValueError, match="optimizers is not supported"):
        GRPOTrainer(
            model=tiny_model_dir,
            reward_funcs=reward_len,
            optimizers=(object(), None),
            args=args_for(tmp_path),
        )
    with pytest.raises(ValueError, match="quantization_config is not supported"):
        GRPOTrainer(
            model=tiny_model_dir, reward_funcs=reward_len, quantization_config={}, args=args_for(tmp_path)
        )


def test_the_tools_script_trains_with_functions_defined_in_it(tmp_path, chat_model_dir):
    def multiply(a: int, b: int) -> int:
        """
        Multiplies two integers.

        Args:
            a: The first integer.
            b: The second integer.

        Returns:
            The product of the two integers.
        """
        return a * b

    def accuracy(completions, answer, **kwargs):
        return [float(target in str(completion)) for completion, target in zip(completions, answer)]

    trainer = GRPOTrainer(
        model=chat_model_dir,
        reward_funcs=accuracy,
        args=args_for(tmp_path, max_completion_length=8),
        train_dataset=chat_dataset(),
        tools=[multiply],
    )
    assert trainer.config.agent.tools == [f"{__name__}:{multiply.__qualname__}"]
    trainer.train()

    assert trainer.state.global_step == 2 and "rewards/accuracy/mean" in trainer.state.log_history[-1]
    assert trainer._loop.source.rollout.runner.tools == [multiply]  # the script's own function
    assert not PROVIDED  # provided while the run was built, and no longer


def test_a_rollout_func_defined_in_the_script_plays_the_rollouts(tmp_path, tiny_model_dir):
    calls = []

    def rollout_func(prompts, trainer):
        calls.append(list(prompts))
        outputs = generate_rollout_completions(trainer, prompts)
        return {
            "prompt_ids": [out["prompt_ids"] for out in outputs],
            "completion_ids": [out["completion_ids"] for out in outputs],
            "logprobs": [out["logprobs"] for out in outputs],
            "env_reward": [float(len(out["completion_ids"])) for out in outputs],
        }

    def reward_from_env(completions, env_reward, **kwargs):
        return env_reward

    trainer = GRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=reward_from_env,
        args=args_for(tmp_path),
        train_dataset=Dataset.from_dict({"prompt": ["ab", "cd", "ef", "gh"]}),
        rollout_func=rollout_func,
    )
    trainer.train()

    assert len(calls) == 2 and all(len(prompts) == 4 for prompts in calls)
    assert trainer.state.log_history[-1]["rewards/reward_from_env/mean"] >= 0


def test_an_environment_class_defined_in_the_script_plays_each_episode(tmp_path, chat_model_dir):
    resets = []

    class Calculator:
        def reset(self, **row) -> None:
            resets.append(row["answer"])
            self.calls = 0

        def add(self, a: int, b: int) -> int:
            """
            Adds two integers.

            Args:
                a: The first integer.
                b: The second integer.
            """
            self.calls += 1
            return a + b

        def get_reward(self) -> float:
            return float(self.calls)

    trainer = GRPOTrainer(
        model=chat_model_dir,
        args=args_for(tmp_path, max_completion_length=8),
        train_dataset=chat_dataset(),
        environment_factory=Calculator,
    )
    trainer.train()

    assert sorted(set(resets)) == ["10", "12"] and len(resets) == 2 * 4  # one reset per episode
    assert "rewards/Calculator/mean" in trainer.state.log_history[-1]


QUICKSTART = """
import sys

from datasets import Dataset
{import_line}

dataset = Dataset.from_dict({{"prompt": ["ab", "cd", "ef", "gh"]}})


def reward_len(completions, **kwargs):
    return [-abs(4 - len(completion)) for completion in completions]


training_args = GRPOConfig(
    output_dir=sys.argv[2],
    per_device_train_batch_size=2,
    num_generations=2,
    max_completion_length=4,
    max_steps=1,
    logging_steps=1,
    save_strategy="no",
    report_to="none",
    use_cpu=True,
    bf16=False,
)
trainer = GRPOTrainer(model=sys.argv[1], reward_funcs=reward_len, args=training_args, train_dataset=dataset)
trainer.train()
print("trained", trainer.state.global_step)
"""
"""TRL's quickstart, shrunk to the tiny model and one step on the CPU."""


@pytest.mark.slow
@pytest.mark.parametrize("package", ["trl", "grpoflow"])
def test_the_quickstart_script_runs_under_trl_and_under_grpoflow(tmp_path, tiny_model_dir, package):
    pytest.importorskip("trl")
    script = tmp_path / "quickstart.py"
    script.write_text(QUICKSTART.format(import_line=f"from {package} import GRPOConfig, GRPOTrainer"))
    env = clean_env(HF_HUB_OFFLINE="1", TRL_EXPERIMENTAL_SILENCE="1", WANDB_DISABLED="true")
    result = subprocess.run(
        [sys.executable, str(script), tiny_model_dir, str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "trained 1" in result.stdout


def test_every_trl_trainer_argument_is_a_grpoflow_argument_in_the_same_order():
    trl = pytest.importorskip("trl")
    theirs = list(inspect.signature(trl.GRPOTrainer.__init__).parameters)
    ours = list(inspect.signature(GRPOTrainer.__init__).parameters)
    assert ours == theirs


REFUSED_TRL_FIELDS = frozenset(
    [
        "adam_epsilon",
        "optim_target_modules",
        "average_tokens_across_devices",
        "label_smoothing_factor",
        "bf16_full_eval",
        "fp16_full_eval",
        "torch_compile_backend",
        "torch_compile_mode",
        "liger_kernel_config",
        "use_cache",
        "neftune_noise_alpha",
        "torch_empty_cache_steps",
        "auto_find_batch_size",
        "log_on_each_node",
        "logging_nan_inf_filter",
        "project",
        "trackio_space_id",
        "trackio_bucket_id",
        "trackio_static_space_id",
        "eval_delay",
        "prediction_loss_only",
        "eval_do_concat_batches",
        "eval_use_gather_object",
        "eval_accumulation_steps",
        "include_for_metrics",
        "batch_eval_metrics",
        "save_only_model",
        "save_on_each_node",
        "enable_jit_checkpoint",
        "ignore_data_skip",
        "restore_callback_states_from_checkpoint",
        "full_determinism",
        "data_seed",
        "accelerator_config",
        "parallelism_config",
        "dataloader_prefetch_factor",
        "dataloader_multiprocessing_context",
        "dataloader_in_order",
        "train_sampling_strategy",
        "length_column_name",
        "ddp_bucket_cap_mb",
        "ddp_broadcast_buffers",
        "ddp_static_graph",
        "ddp_backend",
        "fsdp_config",
        "deepspeed",
        "debug",
        "skip_memory_metrics",
        "do_train",
        "do_eval",
        "do_predict",
        "local_rank",
        "disable_dropout",
        "cast_lm_head_to_fp32",
        "ds3_gather_for_generation",
        "pad_to_multiple_of",
        "generation_kwargs",
        "chat_template_kwargs",
        "cache_implementation",
        "vllm_model_impl",
        "vllm_enable_sleep_mode",
        "vllm_structured_outputs_regex",
        "vllm_group_port",
        "vllm_max_model_length",
        "sync_ref_model",
        "ref_model_mixup_alpha",
        "ref_model_sync_steps",
        "use_bias_correction_kl",
        "log_multimodal",
        "num_completions_to_print",
        "log_unique_prompts",
        "log_completions_hub_repo",
        "use_transformers_continuous_batching",
        "transformers_continuous_batching_config",
        "use_transformers_paged",
        "vllm_importance_sampling_cap",
    ]
)
"""trl.GRPOConfig fields (at TRL's defaults) that grpoflow's GRPOConfig refuses, each by its name
and with why (or what to set instead)."""


def test_every_trl_config_field_is_accepted_or_refused_by_name(tmp_path):
    trl = pytest.importorskip("trl")
    refused = set()
    for field in dataclasses.fields(trl.GRPOConfig):
        if not field.init or field.name == "output_dir":
            continue
        factory = field.default_factory
        value = field.default if factory is dataclasses.MISSING else factory()
        try:
            GRPOConfig(output_dir=str(tmp_path), **{field.name: value})
        except (TypeError, ValueError) as error:
            assert field.name in str(error), str(error)
            assert "is not supported: grpoflow" in str(error), str(error)
            refused.add(field.name)
    assert refused == REFUSED_TRL_FIELDS, (
        f"newly refused: {sorted(refused - REFUSED_TRL_FIELDS)}; "
        f"now accepted: {sorted(REFUSED_TRL_FIELDS - refused)}"
    )
