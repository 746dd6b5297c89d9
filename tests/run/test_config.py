from pathlib import Path

import pytest
import yaml

from grpoflow.agents.setup import load_environment_factory
from grpoflow.agents.tools import resolve_tools
from grpoflow.options import parse_overrides
from grpoflow.run.config import GRPOConfig, load_config

PACKAGED_RECIPE = Path(__file__).parents[2] / "grpoflow" / "recipes" / "default.yaml"
REPO_RECIPES = sorted((Path(__file__).parents[2] / "recipes").glob("*.yaml"))

# The smallest set of keys that makes a valid config.
MINIMAL = {
    "model": "tiny",
    "dataset": "echo",
    "reward_funcs": "echo",
    "num_generations": 4,
    "per_device_train_batch_size": 8,
}


def build(**overrides) -> GRPOConfig:
    return GRPOConfig.from_flat_dict({**MINIMAL, **overrides})


def write_yaml(path: Path, values: dict) -> Path:
    path.write_text(yaml.safe_dump(values))
    return path


# command-line overrides (their parsing: tests/test_options.py)


def test_overrides_reach_the_config_typed():
    words = "--learning_rate 1e-6 --max_steps=3 --log_completions --reward_funcs accuracy format"
    overrides = parse_overrides([*words.split(), "--reward_weights", "1", "0.5", "--epsilon_high", "0.28"])
    config = GRPOConfig.from_flat_dict({**MINIMAL, **overrides})
    assert config.training.learning_rate == pytest.approx(1e-6)
    assert config.training.max_steps == 3
    assert config.log.log_completions is True
    assert config.rewards.reward_funcs == ["accuracy", "format"]
    assert config.rewards.reward_weights == [1.0, 0.5]
    assert config.algorithm.clip.epsilon_high == pytest.approx(0.28)


# type coercion


@pytest.mark.parametrize(
    ("text", "expected"),
    [("true", True), ("True", True), ("1", True), ("yes", True), ("on", True)]
    + [("false", False), ("FALSE", False), ("0", False), ("no", False), ("off", False)],
)
def test_bool_strings(text, expected):
    assert build(gradient_checkpointing=text).policy.gradient_checkpointing is expected


def test_numbers_from_strings_and_yaml():
    config = build(learning_rate="1e-6", max_steps="7", temperature=1, top_k="-1", warmup_ratio="0.1")
    assert config.training.learning_rate == pytest.approx(1e-6)
    assert isinstance(config.training.learning_rate, float)
    assert config.training.max_steps == 7
    assert isinstance(config.generation.sampling.temperature, float)
    assert config.generation.sampling.top_k == -1
    assert config.training.warmup_ratio == pytest.approx(0.1)
    # YAML reads 1e-6 (no dot) as a string and 1.0e-6 as a float; both must work.
    assert yaml.safe_load("x: 1e-6")["x"] == "1e-6"
    assert build(**yaml.safe_load("learning_rate: 1e-6")).training.learning_rate == pytest.approx(1e-6)
    assert build(**yaml.safe_load("learning_rate: 1.0e-6")).training.learning_rate == pytest.approx(1e-6)
    assert build(max_steps=5.0).training.max_steps == 5


@pytest.mark.parametrize("text", [None, "None", "null", "NULL"])
def test_none_for_optional_keys(text):
    config = build(save_total_limit=text, epsilon_high=text, system=text)
    assert config.training.save_total_limit is None
    assert config.algorithm.clip.epsilon_high is None
    assert config.data.system is None


def test_optional_keys_take_values():
    config = build(save_total_limit="2", delta="1.5", system="be brief", move_model_batches="4")
    assert config.training.save_total_limit == 2
    assert config.vllm.move_model_batches == 4 and build().vllm.move_model_batches is None
    assert config.algorithm.clip.delta == pytest.approx(1.5)
    assert config.data.system == "be brief"


def test_comma_lists_and_single_values_become_lists():
    config = build(dataset="echo, gsm8k#5", reward_funcs="accuracy,format", report_to="none")
    assert config.data.dataset == ["echo", "gsm8k#5"]
    assert config.rewards.reward_funcs == ["accuracy", "format"]
    assert config.log.report_to == ["none"]
    assert build(stop="</answer>").generation.sampling.stop == ["</answer>"]


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("max_steps", "1.5", "max_steps must be an integer"),
        ("max_steps", "ten", "max_steps must be an integer"),
        ("max_steps", True, "max_steps must be an integer"),
        ("learning_rate", "fast", "learning_rate must be a number"),
        ("learning_rate", True, "learning_rate must be a number"),
        ("temperature", None, "temperature must be a number"),
        ("log_completions", "maybe", "log_completions must be true or false"),
        ("dataset_split", None, "dataset_split must be text"),
        ("dataset_split", {"a": 1}, "dataset_split must be text"),
        ("report_to", "slack", "report_to must be one of tensorboard, wandb, none, all"),
    ],
)
def test_values_of_the_wrong_type_are_rejected(key, value, message):
    with pytest.raises(ValueError, match=message):
        build(**{key: value})


def test_empty_lists_in_yaml_mean_unset(tmp_path):
    # `dataset:` with nothing after it is YAML null: the dataset is missing, not one named "None".
    recipe = write_yaml(tmp_path / "r.yaml", {**MINIMAL, "dataset": None})
    with pytest.raises(ValueError, match="dataset must be set"):
        load_config(recipe)
    recipe = write_yaml(tmp_path / "r.yaml", {**MINIMAL, "stop": None})
    assert load_config(recipe).generation.sampling.stop == []


# aliases and shared keys


def test_overlong_filter_is_an_alias():
    assert build(overlong_filter="true").algorithm.mask_truncated_completions is True
    assert build(**{"overlong-filter": False}).algorithm.mask_truncated_completions is False


def test_rlhf_type_is_accepted_and_ignored():
    assert build(rlhf_type="grpo") == build()


def test_max_completion_length_reaches_generation_and_rewards():
    config = build(max_completion_length="77")
    assert config.generation.max_completion_length == 77
    assert config.rewards.max_completion_length == 77
    assert config.rewards.effective_soft_max_length == 77


# YAML recipes


def test_flat_yaml(tmp_path):
    recipe = write_yaml(tmp_path / "flat.yaml", {**MINIMAL, "beta": 0.04, "loss_type": "grpo"})
    config = load_config(recipe)
    assert config.algorithm.beta == pytest.approx(0.04)
    assert config.algorithm.loss_type == "grpo"
    assert config.data.dataset == ["echo"]


def test_yaml_nested_by_section_and_overrides_win(tmp_path):
    values = {
        "policy": {"model": "tiny", "torch_dtype": "float32"},
        "data": {"dataset": ["echo"], "max_prompt_length": 32},
        "generation": {"num_generations": 4, "max_completion_length": 16},
        "training": {"per_device_train_batch_size": 8, "max_steps": 10},
        "rewards": {"reward_funcs": ["echo"]},
        "reward_params": {"reward_timeout": 5},
        "algorithm": {"beta": 0.1},
    }
    recipe = write_yaml(tmp_path / "nested.yaml", values)
    config = load_config(recipe, {"max_steps": "20", "beta": "0"})
    assert config.policy.torch_dtype == "float32"
    assert config.data.max_prompt_length == 32
    assert config.generation.max_completion_length == 16
    assert config.rewards.max_completion_length == 16
    assert config.rewards.reward_timeout == pytest.approx(5.0)
    assert config.training.max_steps == 20
    assert config.algorithm.beta == 0.0


def test_load_config_without_a_file_uses_overrides():
    assert load_config(None, dict(MINIMAL)).policy.model == "tiny"


def test_load_config_bad_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="must hold a mapping"):
        load_config(listing)


def test_unknown_yaml_key_is_named(tmp_path):
    recipe = write_yaml(tmp_path / "r.yaml", {**MINIMAL, "num_generation": 4})
    with pytest.raises(ValueError, match="unknown config key 'num_generation'; did you mean num_generations"):
        load_config(recipe)


def test_packaged_recipe_loads():
    config = load_config(PACKAGED_RECIPE)
    assert config.policy.model == "tiny"
    assert config.data.dataset == ["echo"]
    assert config.rewards.reward_funcs == ["echo"]
    assert config.generation_batch_size % config.generation.num_generations == 0


@pytest.mark.skipif(not REPO_RECIPES, reason="recipes/ holds no YAML files")
@pytest.mark.parametrize("recipe", REPO_RECIPES, ids=lambda path: path.name)
def test_repository_recipes_load(recipe):
    config = load_config(recipe)
    resolve_tools(config.agent.tools)  # each tool imports and describes itself to the chat template
    load_environment_factory(config.agent.environment_factory)


def test_the_calculator_recipe_gives_qwen_the_calculate_tool_on_gsm8k():
    config = load_config(Path(__file__).parents[2] / "recipes" / "qwen2.5-1.5b-gsm8k-calculator.yaml")
    (tool,) = resolve_tools(config.agent.tools)
    assert tool.__name__ == "calculate" and config.data.dataset == ["gsm8k"]
    assert config.agent.max_tool_calling_iterations and config.agent.tool_call_parser == "hermes"
    assert config.rewards.reward_funcs[0] == "accuracy"


# unknown keys and bad values


def test_unknown_key_suggests_a_close_match():
    with pytest.raises(ValueError, match=r"unknown config key 'learning_rat'; did you mean learning_rate\?"):
        build(learning_rat=1e-5)


def test_unknown_key_without_close_match():
    with pytest.raises(ValueError, match="unknown config key 'zzz'") as error:
        build(zzz=1)
    assert "did you mean" not in str(error.value)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"loss_type": "foo"},
            "loss_type must be one of grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo; got 'foo'",
        ),
        ({"scale_rewards": "std"}, "scale_rewards must be one of group, batch, none"),
        ({"num_generations": 1}, "num_generations must be >= 2"),
        ({"top_p": 0}, r"top_p must be in \(0, 1\], got 0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"min_p": -0.1}, r"min_p must be in \[0, 1\]"),
        ({"temperature": 0}, "temperature must be > 0"),
        ({"learning_rate": -1}, "learning_rate must be > 0"),
        ({"beta": -0.1}, "beta must be >= 0"),
        ({"delta": 0.5}, "delta must be > 1"),
        ({"sapo_temperature_neg": 0}, r"sapo_temperature_neg must be > 0 \(it divides the gate\), got 0"),
        ({"vespo_lambda_pos": -1}, "vespo_lambda_pos must be >= 0, got -1"),
        ({"kl_in_reward": True}, "beta must be > 0 under kl_in_reward, got 0.0: set beta"),
        ({"kl_estimator": "k4"}, "kl_estimator must be one of k1, k2, k3, low_var_kl; got 'k4'"),
        ({"entropy_coef": -0.1}, "entropy_coef must be >= 0, got -0.1"),
        ({"top_entropy_quantile": 1.5}, r"top_entropy_quantile must be in \[0, 1\], got 1.5"),
        (
            {"off_policy_mask_threshold": -1},
            r"off_policy_mask_threshold must be >= 0 \(or null: off\), got -1",
        ),
        (
            {"use_adaptive_entropy": True, "entropy_coef_min": 0.5, "entropy_coef_max": 0.1},
            r"entropy_coef_min must be at most entropy_coef_max \(0.1\), got 0.5",
        ),
        ({"use_adaptive_entropy": True, "entropy_coef_delta": 0}, "entropy_coef_delta must be > 0, got 0"),
        (
            {"multi_objective_aggregation": "normalize_then_sum", "adv_estimator": "rloo"},
            "multi_objective_aggregation must be sum_then_normalize with another adv_estimator",
        ),
        (
            {"multi_objective_aggregation": "sum"},
            "multi_objective_aggregation must be one of sum_then_normalize",
        ),
        ({"adv_estimator": "ppo"}, "adv_estimator must be one of grpo, rloo, .* or an import path"),
        ({"max_steps": 0}, "max_steps must be > 0, or -1"),
        ({"warmup_ratio": 1.0}, r"warmup_ratio must be in \[0, 1\)"),
        ({"save_total_limit": 0}, "save_total_limit must be > 0"),
        ({"max_prompt_length": 0}, "max_prompt_length must be > 0"),
        ({"truncation_strategy": "right"}, "truncation_strategy must be one of delete, left, raise"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in"),
        ({"move_model_batches": 0}, r"move_model_batches must be >= 1 \(or null for a single push\), got 0"),
        ({"soft_cache_length": 600}, "soft_cache_length must be in"),
        (
            {"per_device_train_batch_size": 6},
            "gradient_accumulation_steps must be divisible by num_generations = 4, got 6",
        ),
        (
            {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 3},
            "gradient_accumulation_steps must be divisible by num_generations = 4, got 6",
        ),
        ({"reward_weights": [1.0, 2.0]}, "reward_weights must be one weight per reward: there are 1 rewards"),
        ({"model": None}, "model must be set, got None: pass --model"),
        ({"dataset": []}, "dataset must be set"),
        ({"reward_funcs": []}, "a run needs a reward: set reward_funcs"),
    ],
)
def test_bad_values_name_the_key(values, message):
    with pytest.raises(ValueError, match=message):
        build(**values)


def test_reward_model_counts_as_a_reward():
    config = build(reward_funcs=[], reward_model="some/classifier", reward_weights=[0.5])
    assert config.rewards.reward_model == "some/classifier"
    with pytest.raises(ValueError, match="reward_weights must be one weight per reward: there are 2 rewards"):
        build(reward_model="some/classifier", reward_weights=[1.0])


def test_batch_divisible_with_accumulation():
    config = build(per_device_train_batch_size=2, gradient_accumulation_steps=6, num_generations=4)
    assert config.generation_batch_size == 12


def test_total_steps():
    config = build(num_train_epochs=2, per_device_train_batch_size=8, num_generations=4)
    assert config.total_steps(num_prompts=5) == 5  # 2 prompts per step, 10 prompts to see
    assert build(max_steps=3).total_steps(num_prompts=1000) == 3


# round trip


def test_flat_dict_round_trip():
    config = build(
        beta=0.04,
        system="think first",
        stop="</answer>",
        reward_funcs="accuracy,format",
        reward_weights=[1, 0.5],
        max_completion_length=99,
        save_total_limit=3,
        report_to="none",
    )
    assert config.rewards.reward_funcs == ["accuracy", "format"]
    flat = config.to_flat_dict()
    assert flat["max_completion_length"] == 99
    assert "policy" not in flat and "model" in flat
    again = GRPOConfig.from_flat_dict(flat)
    assert again == config
    assert again is not config
    # and through YAML, as a run's saved config would travel
    assert GRPOConfig.from_flat_dict(yaml.safe_load(yaml.safe_dump(flat))) == config


def test_async_generation_must_allow_the_staleness_of_spaced_syncs():
    base = {
        "model": "tiny",
        "dataset": ["echo"],
        "reward_funcs": ["format"],
        "async_generate": True,
        "use_vllm": True,
        "vllm_mode": "server",
    }
    with pytest.raises(ValueError, match="max_staleness"):
        load_config(None, {**base, "weight_sync_interval": 2})
    assert (
        load_config(None, {**base, "weight_sync_interval": 2, "max_staleness": 2}).off_policy.max_staleness
        == 2
    )


def test_a_config_built_in_python_gives_the_rewards_its_completion_budget():
    from grpoflow.engines.base import SamplingParams
    from grpoflow.rewards import RewardConfig
    from grpoflow.run.config import GenerationConfig

    config = GRPOConfig(
        **{key: section for key, section in build().__dict__.items() if key not in {"generation", "rewards"}},
        generation=GenerationConfig(sampling=SamplingParams(max_tokens=48)),
        rewards=RewardConfig(reward_funcs=["format"], soft_cache_length=8),
    )
    assert config.rewards.max_completion_length == 48 == config.rewards.effective_soft_max_length
    assert build(max_completion_length=600, soft_cache_length=512).rewards.max_completion_length == 600


def test_total_steps_count_the_global_batch_over_ranks():
    config = build(num_train_epochs=1, per_device_train_batch_size=8, num_generations=4)
    assert config.total_steps(num_prompts=8) == 4
    assert config.total_steps(num_prompts=8, world_size=2) == 2


def test_async_generation_is_refused_for_an_engine_inside_the_trainer():
    with pytest.raises(ValueError, match="async_generate needs a rollout server"):
        build(async_generate=True)


# agent programs


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"tools": ["m:f"]}, "agent_program must be unset with tools, environment_factory or rollout_func"),
        (
            {"environment_factory": "m:E"},
            "agent_program must be unset with tools, environment_factory or rollout_func",
        ),
        (
            {"rollout_func": "m:f"},
            "agent_program must be unset with tools, environment_factory or rollout_func",
        ),
        ({"agent_concurrency": 0}, "agent_concurrency must be >= 1"),
        ({"agent_timeout": 0}, "agent_timeout must be > 0"),
        (
            {"use_vllm": True, "vllm_tensor_parallel_size": 2},
            "vllm_tensor_parallel_size must be 1 with agent_program",
        ),
        (
            {
                "atropos_url": "http://x",
                "use_vllm": True,
                "vllm_mode": "server",
                "max_steps": 3,
                "dataset": [],
            },
            "agent_program must be unset with atropos_url",
        ),
    ],
)
def test_agent_program_settings_that_cannot_work_are_refused(overrides, words):
    with pytest.raises(ValueError, match=words):
        build(agent_program="m:agent", **overrides)


def test_an_agent_program_is_a_reward_of_its_own():
    config = build(agent_program="m:agent", reward_funcs=[])
    assert config.agent.agent_program == "m:agent" and config.agent.agent_concurrency == 64
    assert config.agent.agent_timeout == 600.0 and not config.agent.enabled


def test_adv_estimator_by_name_or_import_path():
    from grpoflow.algo import ADV_ESTIMATORS
    from grpoflow.algo.estimators import rloo_advantages

    assert (
        build(adv_estimator="reinforce_plus_plus").algorithm.advantage_estimator()
        is ADV_ESTIMATORS["reinforce_plus_plus"]
    )
    by_path = build(adv_estimator="grpoflow.algo.estimators:rloo_advantages").algorithm
    assert by_path.advantage_estimator() is rloo_advantages
    with pytest.raises(ValueError, match="has no attribute 'nothing'"):
        build(adv_estimator="grpoflow.algo.estimators:nothing").algorithm.advantage_estimator()
