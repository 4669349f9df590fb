"""Chat messages to prompt text and prompt token ids, with a Hugging Face tokenizer's chat
template: the one path from a conversation to the ids a model is fed. `LLM.chat` calls
`encode_chat` directly; the server, `EngineClient` and RL call it through
`ridgeline.llm.chat_template`, which turns their typed `Message`s into the dicts taken
here. So the same conversation gives the same ids wherever it is sent.

It sits below the engine and the model clients (it imports only `errors`, and duck-types
the tokenizer) so that both can use it: the engine may not import `ridgeline.llm`.

Messages are OpenAI-shaped dicts: ``role`` (``developer`` is read as ``system``),
``content`` (a string, None, or a list of text parts), ``tool_calls``
(``[{"id", "type", "function": {"name", "arguments"}}]``, arguments an object or its
JSON string), ``tool_call_id`` and ``name``; tools are OpenAI tool dicts
(``{"type": "function", "function": {"name", "description", "parameters"}}``).

A template that knows about tools (it mentions ``tools``, as Qwen's and Hermes' do) gets
them natively, together with ``tool_calls`` and ``tool`` messages. A template that does
not (SmolLM2's) gets a Hermes-style tool description in the system message; past tool
calls are written back into the assistant text as ``<tool_call>`` blocks and tool results
become user turns wrapped in ``<tool_response>``, so the model sees the same convention it
is asked to produce. A tokenizer without any template gets ChatML.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from ridgeline.errors import ConfigError

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

ChatMessages = Sequence[Mapping[str, Any]]


def template_source(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one renders chat
        template = template.get("default") or next(iter(template.values()), None)
    return template or CHATML_TEMPLATE


def template_supports_tools(tokenizer: Any) -> bool:
    return "tools" in template_source(tokenizer)


def tool_call_text(name: str, arguments: Any) -> str:
    """The Hermes text form of a call: what text-only templates show of past calls, and
    what the model is asked to write."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def openai_tool(tool: Mapping[str, Any]) -> dict[str, Any]:
    """An OpenAI tool dict with every field filled in (the server's defaults), so a tool
    renders the same whichever client described it."""
    fn = tool.get("function", tool)
    return {"type": "function",
            "function": {"name": fn["name"], "description": fn.get("description") or "",
                         "parameters": fn.get("parameters") or {"type": "object",
                                                                "properties": {}}}}


def tools_system_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    return TOOLS_SYSTEM_PROMPT.format(
        tools="\n".join(json.dumps(openai_tool(t)) for t in tools))


def _text(content: Any, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text" or part.get("text") is None:
            raise ConfigError(f"message {i}: content of type {part.get('type')!r} is not "
                              "supported (this model reads text only)")
        parts.append(part["text"])
    return "".join(parts)


def _arguments(raw: Any) -> Any:
    """Arguments as an object, which is what Qwen/Llama templates serialise with `tojson`
    (OpenAI sends a JSON string); a string that is not a JSON object stays as it is."""
    if raw is None or (isinstance(raw, str) and not raw.strip()):
        return {}
    if isinstance(raw, str):
        try:
            obj = json.loads(raw, strict=False)
        except json.JSONDecodeError:
            return raw
        return obj if isinstance(obj, dict) else raw
    return raw


def _message(m: Mapping[str, Any], i: int) -> dict[str, Any]:
    """A message with every field in one shape; what a template takes is chosen later."""
    if "role" not in m:
        raise ConfigError(f"message {i} has no role", hint="give every message a 'role'")
    calls = [{"id": c.get("id") or f"call_{i}_{j}", "type": "function",
              "function": {"name": c["function"]["name"],
                           "arguments": _arguments(c["function"].get("arguments"))}}
             for j, c in enumerate(m.get("tool_calls") or [])]
    return {"role": "system" if m["role"] == "developer" else m["role"],
            "content": _text(m.get("content"), i), "tool_calls": calls,
            "tool_call_id": m.get("tool_call_id"), "name": m.get("name")}


def template_messages(messages: ChatMessages, native_tools: bool) -> list[dict[str, Any]]:
    """The dicts handed to the template: with tool fields for a template that knows
    tools, with calls and results written as Hermes text for one that does not."""
    out: list[dict[str, Any]] = []
    for i, raw in enumerate(messages):
        m = _message(raw, i)
        if native_tools:
            d: dict[str, Any] = {"role": m["role"], "content": m["content"]}
            if m["tool_calls"]:
                d["tool_calls"] = m["tool_calls"]
            if m["tool_call_id"] is not None:
                d["tool_call_id"] = m["tool_call_id"]
            if m["name"] is not None:
                d["name"] = m["name"]
            out.append(d)
        elif m["role"] == "tool":
            out.append({"role": "user",
                        "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m["tool_calls"]:
            calls = "\n".join(tool_call_text(c["function"]["name"], c["function"]["arguments"])
                              for c in m["tool_calls"])
            content = f"{m['content']}\n{calls}" if m["content"] else calls
            out.append({"role": m["role"], "content": content})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    return out


def render_prompt(tokenizer: Any, messages: ChatMessages,
                  tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """The prompt text, ending with the assistant generation prefix."""
    if not messages:
        raise ConfigError("cannot render an empty conversation", hint="pass at least one message")
    template = template_source(tokenizer)
    native = "tools" in template
    dicts = template_messages(messages, native_tools=native)
    kwargs: dict[str, Any] = {}
    if tools and native:
        kwargs["tools"] = [openai_tool(t) for t in tools]
    elif tools:
        block = tools_system_prompt(tools)
        if dicts[0]["role"] == "system":
            dicts[0] = {**dicts[0], "content": f"{dicts[0]['content']}\n\n{block}"}
        else:
            dicts.insert(0, {"role": "system", "content": block})
    return tokenizer.apply_chat_template(dicts, tokenize=False, add_generation_prompt=True,
                                         chat_template=template, **kwargs)


def encode_chat(tokenizer: Any, messages: ChatMessages,
                tools: Sequence[Mapping[str, Any]] | None = None,
                reply_prefix: str = "") -> list[int]:
    """The prompt token ids of a conversation: `render_prompt`'s text followed by
    `reply_prefix` (the forced start of the reply, e.g. the opening of a tool call the
    server requires), encoded as one string so the ids at the seam are the ones the
    tokenizer would choose. No special tokens are added: the template already wrote BOS
    and every role marker into the text, and a second BOS would change the ids."""
    text = render_prompt(tokenizer, messages, tools)
    return list(tokenizer.encode(text + reply_prefix, add_special_tokens=False))


_REPLY_MARK = "ridgeline-reply-mark"


def continuation_ids(tokenizer: Any, messages: ChatMessages,
                     last_token_text: str = "") -> list[int]:
    """The ids to append after an assistant reply the model just generated so that the
    conversation goes on with `messages` (observations: user or tool turns) and a new
    generation prompt, rendered by the same template as `encode_chat`.

    Multi-turn RL appends these to the ids it already has instead of re-encoding the
    whole conversation, so earlier turns keep exactly the ids that were sampled. The
    template's closing of an assistant turn (e.g. ``<|im_end|>\\n``) comes first, minus
    what the reply's last sampled token (`last_token_text`, e.g. the end-of-turn token)
    already wrote."""
    if not messages or any(m.get("role") == "assistant" for m in messages):
        raise ConfigError("a continuation holds the turns after a reply (user or tool), "
                          "not another assistant message",
                          hint="pass only the observations that follow the model's reply")
    template = template_source(tokenizer)
    native = "tools" in template
    base = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
            {"role": "assistant", "content": _REPLY_MARK}]

    def render(msgs: ChatMessages, generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(template_messages(msgs, native_tools=native),
                                             tokenize=False, chat_template=template,
                                             add_generation_prompt=generation_prompt)

    before = render(base, False)
    after = render([*base, *messages], True)
    if not after.startswith(before) or _REPLY_MARK not in before:
        raise ConfigError("this chat template rewrites earlier turns when a turn is added, "
                          "so turns cannot be appended as token ids",
                          hint="use a model whose template renders turns incrementally "
                               "(ChatML, Llama 3, Qwen 2.5)")
    closing = before[before.index(_REPLY_MARK) + len(_REPLY_MARK):]
    if last_token_text and closing.startswith(last_token_text):
        closing = closing[len(last_token_text):]
    return list(tokenizer.encode(closing + after[len(before):], add_special_tokens=False))
