"""Qwen3-Coder tool calls, XML with one element per parameter:

    <tool_call>
    <function=write_file>
    <parameter=path>
    src/app.py
    </parameter>
    <parameter=line_count>
    12
    </parameter>
    </function>
    </tool_call>

Values are raw text (one newline after the opening tag and before the closing one is not
part of them), typed by the tool's JSON schema: strings stream out as they are read;
integers, numbers, booleans, objects and arrays are converted when complete (a value that
does not convert stays a string, ``null`` is null). The arguments are sent as the JSON
object OpenAI clients expect. A block may also start at ``<function=`` directly.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from ridgeline.llm.base import ToolSpec
from ridgeline.llm.parsers.base import ToolCallParser, held_suffix

TOOL_CALL = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
FUNCTION = "<function="
FUNCTION_END = "</function>"
PARAMETER = "<parameter="
PARAMETER_END = "</parameter>"


def _json_text(value: str) -> str:
    """`value` as the inside of a JSON string."""
    return json.dumps(value, ensure_ascii=False)[1:-1]


def typed_value(text: str, json_type: str) -> Any:
    """A parameter's text as the schema's type says, or the text itself."""
    if json_type == "string":
        return text
    value = text.strip()
    if value.lower() == "null":
        return None
    if json_type == "boolean":
        return {"true": True, "false": False}.get(value.lower(), text)
    if json_type == "integer":
        try:
            return int(value)
        except ValueError:
            return text
    if json_type == "number":
        try:
            return int(value)
        except ValueError:
            pass
        try:
            return float(value)
        except ValueError:
            return text
    try:  # object, array, or a type the schema leaves open
        return json.loads(value)
    except json.JSONDecodeError:
        pass
    try:  # Python literals ({'a': 1}, True) are what the model often writes
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return text


class Qwen3CoderParser(ToolCallParser):
    name = "qwen3_coder"

    def __init__(self, tools: list[ToolSpec] | None = None, max_calls: int | None = None) -> None:
        super().__init__(tools, max_calls)
        # content -> block -> function -> params <-> value -> after_function -> content
        self._state = "content"
        self._wrapped = False  # opened by <tool_call> (so closed by </tool_call>)
        self._num_params = 0
        self._param_type = "string"
        self._value = ""  # a non-string value, or a string's held start
        self._value_started = False

    def _schema_type(self, param: str) -> str:
        tool = self.tools.get(self._call.name) if self.tools and self._call else None
        if tool is None:
            return "string"
        schema = (tool.parameters.get("properties") or {}).get(param) or {}
        kind = schema.get("type", "string")
        if isinstance(kind, list):
            kind = next((k for k in kind if k != "null"), "string")
        return kind if isinstance(kind, str) else "string"

    def _advance(self, final: bool) -> None:
        while self._buf:
            buf = self._buf
            if self._state == "content":
                starts = [i for i in (buf.find(TOOL_CALL), buf.find(FUNCTION)) if i >= 0]
                if not starts:
                    keep = 0 if final else held_suffix(buf, TOOL_CALL, FUNCTION)
                    self._content(self._consume(len(buf) - keep))
                    return
                self._content(self._consume(min(starts)))
                self._start_block()
                self._wrapped = self._buf.startswith(TOOL_CALL)
                if self._wrapped:
                    self._read(len(TOOL_CALL))
                self._state = "function"
            elif self._state == "function":
                body = buf.lstrip()
                if not body:
                    self._read(len(buf))
                    break
                if not body.startswith(FUNCTION):
                    if FUNCTION.startswith(body) and not final:
                        break
                    self._state = "after_function"  # no function in this block
                    continue
                close = body.find(">")
                if close < 0:
                    break
                self._read(len(buf) - len(body) + close + 1)
                name = body[len(FUNCTION):close].strip()
                self._num_params = 0
                if self._begin_call(name):
                    self._add_arguments("{")
                self._state = "params"
            elif self._state == "params":
                body = buf.lstrip()
                if not body:
                    self._read(len(buf))
                    break
                skip = len(buf) - len(body)
                if body.startswith(PARAMETER):
                    close = body.find(">")
                    if close < 0:
                        break
                    self._read(skip + close + 1)
                    param = body[len(PARAMETER):close].strip()
                    self._param_type = self._schema_type(param)
                    sep = ", " if self._num_params else ""
                    self._num_params += 1
                    self._add_arguments(f"{sep}{json.dumps(param, ensure_ascii=False)}: ")
                    if self._param_type == "string":
                        self._add_arguments('"')
                    self._value, self._value_started = "", False
                    self._state = "value"
                elif body.startswith(FUNCTION_END):
                    self._read(skip + len(FUNCTION_END))
                    self._add_arguments("}")
                    self._state = "after_function"
                elif (PARAMETER.startswith(body) or FUNCTION_END.startswith(body)) and not final:
                    break
                else:  # stray text between parameters
                    nxt = body.find("<", 1)
                    self._read(len(buf) if nxt < 0 else skip + nxt)
            elif self._state == "value":
                ends = [i for i in (buf.find(PARAMETER_END), buf.find(FUNCTION_END)) if i >= 0]
                if not ends:
                    keep = 0 if final else held_suffix(buf, PARAMETER_END, FUNCTION_END)
                    self._value_piece(self._read(len(buf) - keep), last=False)
                    break
                end = min(ends)
                self._value_piece(self._read(end), last=True)
                if self._buf.startswith(PARAMETER_END):
                    self._read(len(PARAMETER_END))
                self._state = "params"
            else:  # after_function: up to the block's end
                body = buf.lstrip()
                if self._wrapped and body.startswith(FUNCTION):  # a second call in one block
                    self._read(len(buf) - len(body))
                    self._end_block()
                    self._start_block()
                    self._state = "function"
                    continue
                if self._wrapped:
                    end = buf.find(TOOL_CALL_END)
                    if end < 0 and not final:
                        break
                    self._read(len(buf) if end < 0 else end + len(TOOL_CALL_END))
                self._end_block()
                self._state = "content"
        if final:
            self._settle()

    def _value_piece(self, text: str, last: bool) -> None:
        """Part of a parameter's value; `last` when its closing tag follows."""
        if not self._value_started:
            text = self._value + text
            self._value = ""
            if not text and not last:
                return
            text = text.removeprefix("\n")
            self._value_started = True
        if self._param_type != "string":
            self._value += text
            if last:
                value = self._value.removesuffix("\n")
                typed = typed_value(value, self._param_type)
                self._add_arguments(json.dumps(typed, ensure_ascii=False))
                self._value = ""
            return
        text = self._value + text  # a held trailing newline
        self._value = ""
        if last:
            self._add_arguments(_json_text(text.removesuffix("\n")) + '"')
        elif text.endswith("\n"):  # maybe the newline before the closing tag
            self._add_arguments(_json_text(text[:-1]))
            self._value = "\n"
        else:
            self._add_arguments(_json_text(text))

    def _settle(self) -> None:
        """The reply ended inside a block: close what is open."""
        if self._state == "value":
            self._value_piece("", last=True)
            self._state = "params"
        if self._state == "params":
            self._add_arguments("}")
        if self._state != "content":
            self._end_block()
            self._state = "content"
