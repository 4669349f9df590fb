"""Messages to prompt text, and to prompt token ids, with a Hugging Face tokenizer's chat
template. A leaf module (tokenizer duck-typing, no engine), so that every path that turns a
conversation into a prompt (`EngineClient`, the server, benchmarks) goes through
`encode_chat` and feeds the model exactly the same ids.

A template that knows about tools (it mentions ``tools``, as Qwen's and Hermes' do) gets
them natively, together with OpenAI-shaped ``tool_calls`` and ``tool`` messages. A
template that does not (SmolLM2's) gets a Hermes-style tool description in the system
message; past tool calls are written back into the assistant text as ``<tool_call>``
blocks and tool results become user turns wrapped in ``<tool_response>``, so the model
sees the same convention it is asked to produce. A tokenizer without any template gets
ChatML.
"""

from __future__ import annotations

import json
from typing import Any

from ridgeline.errors import ConfigError
from ridgeline.llm.base import Message, ToolSpec
from ridgeline.llm.tool_parser import format_tool_call

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

TOOLS_SYSTEM_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def template_source(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one renders chat
        template = template.get("default") or next(iter(template.values()), None)
    return template or CHATML_TEMPLATE


def template_supports_tools(tokenizer: Any) -> bool:
    return "tools" in template_source(tokenizer)


def tool_to_openai(tool: ToolSpec) -> dict[str, Any]:
    return {"type": "function",
            "function": {"name": tool.name, "description": tool.description,
                         "parameters": tool.parameters}}


def tools_system_prompt(tools: list[ToolSpec]) -> str:
    return TOOLS_SYSTEM_PROMPT.format(
        tools="\n".join(json.dumps(tool_to_openai(t)) for t in tools))


def messages_to_dicts(messages: list[Message], native_tools: bool) -> list[dict[str, Any]]:
    """OpenAI-shaped dicts that HF templates expect (tool arguments as objects, which is
    what Qwen/Llama templates serialise with `tojson`)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if native_tools:
            d: dict[str, Any] = {"role": m.role, "content": m.content}
            if m.tool_calls:
                d["tool_calls"] = [{"id": c.id, "type": "function",
                                    "function": {"name": c.name, "arguments": c.arguments}}
                                   for c in m.tool_calls]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                d["name"] = m.name
            out.append(d)
        elif m.role == "tool":
            out.append({"role": "user",
                        "content": f"<tool_response>\n{m.content}\n</tool_response>"})
        elif m.tool_calls:
            calls = "\n".join(format_tool_call(c) for c in m.tool_calls)
            content = f"{m.content}\n{calls}" if m.content else calls
            out.append({"role": m.role, "content": content})
        else:
            out.append({"role": m.role, "content": m.content})
    return out


def render_prompt(tokenizer: Any, messages: list[Message],
                  tools: list[ToolSpec] | None = None) -> str:
    """The prompt text, ending with the assistant generation prefix."""
    if not messages:
        raise ConfigError("cannot render an empty conversation", hint="pass at least one message")
    template = template_source(tokenizer)
    native = "tools" in template
    dicts = messages_to_dicts(messages, native_tools=native)
    kwargs: dict[str, Any] = {}
    if tools and native:
        kwargs["tools"] = [tool_to_openai(t) for t in tools]
    elif tools:
        block = tools_system_prompt(tools)
        if dicts[0]["role"] == "system":
            dicts[0] = {**dicts[0], "content": f"{dicts[0]['content']}\n\n{block}"}
        else:
            dicts.insert(0, {"role": "system", "content": block})
    return tokenizer.apply_chat_template(dicts, tokenize=False, add_generation_prompt=True,
                                         chat_template=template, **kwargs)


def encode_chat(tokenizer: Any, messages: list[Message], tools: list[ToolSpec] | None = None,
                reply_prefix: str = "") -> list[int]:
    """The prompt token ids of a conversation: `render_prompt`'s text followed by
    `reply_prefix` (the forced start of the reply, e.g. the opening of a tool call the
    server requires), encoded as one string so the ids at the seam are the ones the
    tokenizer would choose. No special tokens are added: the template already wrote BOS
    and every role marker into the text, and a second BOS would change the ids."""
    text = render_prompt(tokenizer, messages, tools)
    return list(tokenizer.encode(text + reply_prefix, add_special_tokens=False))


_REPLY_MARK = "ridgeline-reply-mark"


def continuation_ids(tokenizer: Any, messages: list[Message], last_token_text: str = "") -> list[int]:
    """The ids to append after an assistant reply the model just generated so that the
    conversation goes on with `messages` (observations: user or tool turns) and a new
    generation prompt, rendered by the same template as `encode_chat`.

    Multi-turn RL appends these to the ids it already has instead of re-encoding the
    whole conversation, so earlier turns keep exactly the ids that were sampled. The
    template's closing of an assistant turn (e.g. ``<|im_end|>\\n``) comes first, minus
    what the reply's last sampled token (`last_token_text`, e.g. the end-of-turn token)
    already wrote."""
    if not messages or any(m.role == "assistant" for m in messages):
        raise ConfigError("a continuation holds the turns after a reply (user or tool), "
                          "not another assistant message",
                          hint="pass only the observations that follow the model's reply")
    template = template_source(tokenizer)
    native = "tools" in template
    base = [Message(role="system", content="s"), Message(role="user", content="u"),
            Message(role="assistant", content=_REPLY_MARK)]

    def render(msgs: list[Message], generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(messages_to_dicts(msgs, native_tools=native),
                                             tokenize=False, chat_template=template,
                                             add_generation_prompt=generation_prompt)

    before = render(base, False)
    after = render(base + list(messages), True)
    if not after.startswith(before) or _REPLY_MARK not in before:
        raise ConfigError("this chat template rewrites earlier turns when a turn is added, "
                          "so turns cannot be appended as token ids",
                          hint="use a model whose template renders turns incrementally "
                               "(ChatML, Llama 3, Qwen 2.5)")
    closing = before[before.index(_REPLY_MARK) + len(_REPLY_MARK):]
    if last_token_text and closing.startswith(last_token_text):
        closing = closing[len(last_token_text):]
    return list(tokenizer.encode(closing + after[len(before):], add_special_tokens=False))
