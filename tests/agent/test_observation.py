from __future__ import annotations

from hypothesis import given, settings, strategies as st

from ridgeline.agent.observation import truncate_middle


def test_short_text_is_untouched() -> None:
    assert truncate_middle("hello", 100) == ("hello", False)


def test_long_text_keeps_head_and_tail_with_a_marker() -> None:
    text = "".join(f"line {i}\n" for i in range(10_000))
    out, cut = truncate_middle(text, 2000)
    assert cut and len(out.encode()) <= 2000
    assert out.startswith("line 0\nline 1\n") and out.endswith("line 9999\n")
    assert "bytes (" in out and "elided" in out


@settings(max_examples=200, deadline=None)
@given(st.text(min_size=0, max_size=3000), st.integers(min_value=128, max_value=2000))
def test_always_within_budget_and_valid_utf8(text: str, limit: int) -> None:
    out, cut = truncate_middle(text, limit)
    assert len(out.encode("utf-8")) <= limit
    assert cut == (len(text.encode()) > limit)
