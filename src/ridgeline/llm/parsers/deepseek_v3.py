"""DeepSeek V3 and V3.1 tool calls (R1-0528 writes V3's form):

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>                                  (V3)

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>  (V3.1)

Both are read by one parser: in V3 the name follows the separator on its own line, in
V3.1 it comes before the separator and the arguments follow it directly.
"""

from __future__ import annotations

from ridgeline.llm.parsers.sections import SectionParser


class DeepSeekV3Parser(SectionParser):
    name = "deepseek_v3"
    SECTION_BEGIN = "<｜tool▁calls▁begin｜>"
    SECTION_END = "<｜tool▁calls▁end｜>"
    CALL_BEGIN = "<｜tool▁call▁begin｜>"
    HEADER_END = "<｜tool▁sep｜>"
    CALL_END = "<｜tool▁call▁end｜>"

    def call_name(self, header: str, prelude: str) -> tuple[str, str | None]:
        lines = [line.strip() for line in prelude.strip().splitlines()]
        if lines and lines[0] and not lines[0].startswith("```"):  # V3: the name's line
            return lines[0], None
        return header.strip(), None
