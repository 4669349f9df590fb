"""The parsers through `ridgeline serve`: a tiny Llama whose weights make it write one
fixed Kimi-K2 reply (reasoning, then content, then a call in special tokens) token by
token, behind a chat template that opens ``<think>`` in the prompt and names Kimi's call
tokens, so the server picks kimi_k2 and a <think> parser on its own, keeps the special
tokens in the text, and answers with `reasoning_content`, `content` and `tool_calls`,
whole and streamed."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
import torch
from test_server import EOS, WEATHER_TOOL, engine_for, llama

from ridgeline.errors import ConfigError
from ridgeline.serve.app import ServerThread, create_app
from tests.helpers.engine_fixtures import char_tokenizer

SPECIAL = ["<|tool_calls_section_begin|>", "<|tool_call_begin|>",
           "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<|tool_calls_section_end|>"]
REPLY = ["Need", " the weather.", "</think>", "\n\n", "Checking.", SPECIAL[0], SPECIAL[1],
         "functions.get_weather:0", SPECIAL[2], '{"city": ', '"Paris"}', SPECIAL[3],
         SPECIAL[4]]
TEMPLATE = ("{# Kimi K2 calls: <|tool_calls_section_begin|> #}"
            "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant><think>{% endif %}")
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def kimi_tokenizer() -> Any:
    """The character tokenizer with REPLY's pieces as tokens (Kimi's call markers special)
    and TEMPLATE, which names them, as its chat template."""
    fast = char_tokenizer()
    fast.add_tokens(["<think>"] + [p for p in REPLY if p not in SPECIAL])
    fast.add_special_tokens({"additional_special_tokens": SPECIAL})
    fast.chat_template = TEMPLATE
    return fast


@pytest.fixture(scope="module")
def tok() -> Any:
    return kimi_tokenizer()


@torch.no_grad()
def scripted_llama(tok: Any) -> Any:
    """After '<think>' (the prompt's end) it writes REPLY, then </s>: each position only
    sees its own token, and the head maps each token of the chain to the next."""
    model = llama(len(tok))
    for layer in model.model.layers:
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()
    chain = [tok.convert_tokens_to_ids(p) for p in ["<think>", *REPLY]] + [EOS]
    model.model.embed_tokens.weight.zero_()
    model.lm_head.weight.zero_()
    for j, (src, dst) in enumerate(zip(chain, chain[1:])):
        model.model.embed_tokens.weight[src, j] = 1.0
        model.lm_head.weight[dst, j] = 5.0
    return model


@pytest.fixture(scope="module")
def client(tok: Any):
    with ServerThread(create_app({"kimi": engine_for(scripted_llama(tok), tok)})) as server:
        yield openai.OpenAI(base_url=server.base_url, api_key="-", max_retries=0, timeout=60)


def test_reply_split_into_reasoning_content_and_a_call(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model="kimi", messages=ASK, tools=[WEATHER_TOOL],
                                       temperature=0, max_tokens=40)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Checking."
    assert choice.message.model_extra["reasoning_content"] == "Need the weather."
    (call,) = choice.message.tool_calls
    assert (call.id, call.function.name) == ("functions.get_weather:0", "get_weather")
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    reasoning, content, deltas, finish = "", "", [], None
    for chunk in client.chat.completions.create(model="kimi", messages=ASK, tools=[WEATHER_TOOL],
                                                temperature=0, max_tokens=40, stream=True):
        for c in chunk.choices:
            reasoning += (c.delta.model_extra or {}).get("reasoning_content") or ""
            content += c.delta.content or ""
            deltas += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert (reasoning, content, finish) == ("Need the weather.", "Checking.", "tool_calls")
    assert deltas[0].id == "functions.get_weather:0" and deltas[0].function.name == "get_weather"
    assert len(deltas) > 1 and all(d.id is None for d in deltas[1:])  # arguments in pieces
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"city": "Paris"}

    # Without tools the reasoning is still split; the call tokens are not shown as text.
    r = client.chat.completions.create(model="kimi", messages=ASK, temperature=0, max_tokens=40)
    message = r.choices[0].message
    assert message.model_extra["reasoning_content"] == "Need the weather."
    assert message.tool_calls is None and message.content.startswith("Checking.")


def test_parsers_chosen_by_name_and_bad_names_refused(tok: Any) -> None:
    engine = engine_for(scripted_llama(tok), tok)
    with pytest.raises(ConfigError, match="unknown tool-call parser 'kimi'"):
        create_app({"m": engine}, tool_call_parser="kimi")
    app = create_app({"m": engine}, tool_call_parser="hermes", reasoning_parser="none")
    with ServerThread(app) as server:
        c = openai.OpenAI(base_url=server.base_url, api_key="-", max_retries=0, timeout=60)
        r = c.chat.completions.create(model="m", messages=ASK, tools=[WEATHER_TOOL],
                                      temperature=0, max_tokens=40)
    message = r.choices[0].message
    assert message.tool_calls is None and "reasoning_content" not in message.model_extra
    assert message.content.startswith("Need the weather.</think>")
