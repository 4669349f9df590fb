"""Incremental detokenisation: turn each new token into new text without decoding the
whole output every step, and without emitting half of a multi-byte character.

The trick (as in text streamers): decode a short window [prefix_offset, end) and the part
of it already shown [prefix_offset, read_offset); the new text is the difference. Starting
the window a few tokens back keeps tokenizer-specific spacing right."""

from __future__ import annotations

from typing import Any

from ridgeline.engine.sequence import Sequence


def detokenize_step(tokenizer: Any, seq: Sequence, *, final: bool = False,
                    upto: int | None = None) -> str:
    """Text of the tokens after `read_offset` (up to `upto`, default all), or "" while the
    last character is incomplete (unless `final`)."""
    end = seq.num_tokens if upto is None else upto
    if end <= seq.read_offset:
        return ""
    skip = seq.params.skip_special_tokens
    ids = seq.token_ids
    prefix = _decode(tokenizer, ids[seq.prefix_offset:seq.read_offset], skip)
    full = _decode(tokenizer, ids[seq.prefix_offset:end], skip)
    if not final and (len(full) <= len(prefix) or full.endswith("\ufffd")):
        return ""
    if not full.startswith(prefix):
        # a tokenizer that rewrites earlier text: fall back to the length difference
        new = full[len(prefix):] if len(full) > len(prefix) else ""
    else:
        new = full[len(prefix):]
    seq.prefix_offset = seq.read_offset
    seq.read_offset = end
    return new


def _decode(tokenizer: Any, ids: list[int], skip_special_tokens: bool) -> str:
    """tokenizer.decode, straight to the Rust backend when transformers would add nothing
    (no clean-up of spaces): this runs twice per sequence and step."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
