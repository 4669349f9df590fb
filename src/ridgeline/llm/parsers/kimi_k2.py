"""Kimi K2 tool calls; the header is the call's id, ``functions.<name>:<n>``, which the
chat template writes back as it was, so it is kept as the call id:

    <|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>
"""

from __future__ import annotations

import re

from ridgeline.llm.parsers.sections import SectionParser

_CALL_ID = re.compile(r"(?:functions\.)?(?P<name>[^\s:]+):\d+")


class KimiK2Parser(SectionParser):
    name = "kimi_k2"
    SECTION_BEGIN = "<|tool_calls_section_begin|>"
    SECTION_END = "<|tool_calls_section_end|>"
    CALL_BEGIN = "<|tool_call_begin|>"
    HEADER_END = "<|tool_call_argument_begin|>"
    CALL_END = "<|tool_call_end|>"

    def call_name(self, header: str, prelude: str) -> tuple[str, str | None]:
        header = header.strip()
        m = _CALL_ID.fullmatch(header)
        if m is None:  # no index: the header is the name, maybe with its namespace
            return header.removeprefix("functions."), None
        return m.group("name"), header
