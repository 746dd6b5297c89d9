"""An episode's next prompt built on the tokens its turns sampled (grpoflow.server.continuation):
the conversation an agent program sends back is token for token what the model sampled, though
its text decodes from those tokens in a lossy way. Runs on the CPU: the character tokenizer and a
tiny random model behind the hosted server, driven by the real `openai` client."""

from __future__ import annotations

from array import array

import httpx
import pytest

from grpoflow.engines import Completion, EngineConfig, EngineOptions, build_engine
from grpoflow.policy.tiny import build_char_tokenizer, build_tiny_model
from grpoflow.server.continuation import Resume, prompt_ids, resume_text
from grpoflow.server.protocol import Limits

PAD, EOS, UNK = 0, 1, 2
LIMITS = Limits(model_name="tiny", max_model_len=4096, vocab_size=128, eos_token_ids=(EOS,))


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def render(tokenizer, messages: list[dict]) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def first_turn(tokenizer, sampled: list[int], finish_reason: str = "stop") -> tuple[list[dict], Resume, str]:
    """A one-message episode whose first turn sampled `sampled`: the conversation the program
    sends next (the answer's text, then a user message), and the turn's resume."""
    messages = [{"role": "user", "content": "Define a word."}]
    text = render(tokenizer, messages)
    completion = Completion(sampled, [-1.0] * len(sampled), finish_reason)
    resume = Resume(
        resume_text(text, completion, tokenizer, skip_special_tokens=True),
        array("i", ids(tokenizer, text) + sampled),
    )
    answer = tokenizer.decode(sampled, skip_special_tokens=True)
    later = [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": "Go on."}]
    return later, resume, text


def test_a_turn_extends_what_was_sampled_though_its_text_lost_special_tokens(tokenizer):
    sampled = [*ids(tokenizer, "ab"), PAD, *ids(tokenizer, "c"), UNK, *ids(tokenizer, "d"), EOS]
    later, resume, text = first_turn(tokenizer, sampled)
    rendered = render(tokenizer, later)

    prompt = prompt_ids(rendered, resume, tokenizer, False, LIMITS)

    sampled_sequence = ids(tokenizer, text) + sampled
    assert prompt[: len(sampled_sequence)] == sampled_sequence  # <pad> and <unk> kept where sampled
    assert tokenizer.decode(prompt) == rendered.replace("abcd", "ab<pad>c<unk>d")
    assert ids(tokenizer, rendered)[: len(sampled_sequence)] != sampled_sequence  # what tokenising gives


def test_a_rewritten_history_is_tokenised_whole(tokenizer):
    sampled = [*ids(tokenizer, "ab"), PAD, *ids(tokenizer, "c"), EOS]
    later, resume, _ = first_turn(tokenizer, sampled)
    later[1]["content"] = "(summarised)"
    rendered = render(tokenizer, later)

    assert prompt_ids(rendered, resume, tokenizer, False, LIMITS) == ids(tokenizer, rendered)


def test_a_truncated_turn_ending_on_a_special_token_is_not_read_as_stopped(tokenizer):
    sampled = [*ids(tokenizer, "ab"), UNK]  # cut by max_tokens, not ended by <unk>
    later, resume, text = first_turn(tokenizer, sampled, finish_reason="length")
    rendered = render(tokenizer, later)

    prompt = prompt_ids(rendered, resume, tokenizer, False, LIMITS)

    assert prompt[: len(text) + 3] == ids(tokenizer, text) + sampled
    assert tokenizer.decode(prompt) == rendered.replace("ab<eos>", "ab<unk><eos>")


def test_every_turn_of_agent_episodes_extends_the_last_on_the_hosted_server(tokenizer):
    openai = pytest.importorskip("openai")
    from grpoflow.server.hosted import host_engine

    model = build_tiny_model(len(tokenizer), model_type="llama").eval()
    options = EngineOptions(engine=EngineConfig(max_model_len=1024, max_num_seqs=8))
    engine = build_engine("native", model, tokenizer, options)
    server = host_engine(engine, tokenizer, model_name="policy", max_model_len=1024)
    server.open()
    headers = {"Authorization": f"Bearer {server.api_key}"}
    broken, special = [], 0
    try:
        for episode in range(6):
            client = openai.OpenAI(
                base_url=f"{server.url}/v1",
                api_key=server.api_key,
                default_headers={"X-Episode-Id": f"e{episode}"},
                max_retries=0,
            )
            messages = [{"role": "user", "content": "Define a word."}]
            for turn in range(4):
                answer = client.chat.completions.create(
                    model="policy", messages=messages, max_tokens=24, seed=10 * episode + turn
                )
                messages += [
                    {"role": "assistant", "content": answer.choices[0].message.content},
                    {"role": "user", "content": "Go on."},
                ]
            turns = httpx.get(f"{server.url}/v1/episodes/e{episode}", headers=headers, timeout=30).json()[
                "turns"
            ]
            for earlier, later in zip(turns, turns[1:], strict=False):
                sequence = earlier["prompt_ids"] + earlier["completion_ids"]
                special += sum(token in (PAD, UNK) for token in earlier["completion_ids"])
                if later["prompt_ids"][: len(sequence)] != sequence:
                    broken.append((episode, earlier["index"]))
    finally:
        server.stop()
    assert special > 0  # the random model sampled text its answers could not carry
    assert broken == []
