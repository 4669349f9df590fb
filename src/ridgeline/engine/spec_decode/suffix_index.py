"""Where a context's last tokens occurred before, for n-gram speculation (the `NgramProposer`
in speculative.py).

A `SuffixIndex` is an append-only token stream plus, for each short n-gram order
(`anchors`, e.g. 1..3), the positions that followed each occurrence of each n-gram. It is
updated as tokens are appended (a few dict operations per token), so a lookup costs the
same at 200 and at 8k tokens of context: take the occurrences of the longest anchor n-gram
that ends the context (the most recent `limit`), then extend each match backwards token
by token (up to `max_match`) to rank them by how much of the context they share.

`walk` goes forward from all those occurrences at once, the way a suffix tree of the
stream would be walked below the matched suffix: each step takes the continuation backed
by the longest match (then by the most occurrences, then the most recent), drops the
occurrences that disagree, and reports the evidence for that token (`Evidence`), from
which the caller decides how far the proposal is worth verifying.

`GlobalIndex` keeps earlier requests' outputs in two generations of `SuffixIndex` of at
most half its budget each: when the newer one fills up the older one is dropped, so the
memory stays bounded and no rebuild ever runs on the engine's thread.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: Separates documents in a shared stream (never a token id), so no match crosses them.
SEPARATOR = -1


@dataclass(frozen=True)
class Evidence:
    """What backs one proposed token: the longest match (context tokens shared, counting
    the proposed tokens before it) among the occurrences that continue with it, how many
    occurrences do, how many were still in play, and whether the best comes from the
    request's own tokens."""

    match: int
    support: int
    alive: int
    local: bool


@dataclass
class Match:
    stream: list[int]  # the indexed tokens the occurrence lives in
    pos: int  # the position that followed the matched suffix
    length: int  # context tokens matched
    local: bool  # the stream is the request's own context


class SuffixIndex:
    """Positions that followed each n-gram of the orders in `anchors`, over `tokens` (which
    may be a list owned by someone else that only ever grows: `sync` indexes what was
    appended since)."""

    def __init__(self, anchors: Sequence[int], tokens: list[int] | None = None) -> None:
        if not anchors or min(anchors) < 1:
            raise ValueError(f"anchor orders must be >= 1, got {list(anchors)}")
        self.anchors = tuple(sorted(set(anchors)))
        self.tokens: list[int] = [] if tokens is None else tokens
        self._follow: dict[int, dict[object, list[int]]] = {n: {} for n in self.anchors}
        self.num_indexed = 0
        self.sync()

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        self.tokens.extend(tokens)
        self.sync()

    def sync(self) -> None:
        """Index the tokens appended to `tokens` since the last call."""
        toks = self.tokens
        for i in range(self.num_indexed, len(toks)):
            for n in self.anchors:
                if i < n:
                    break
                key = toks[i - 1] if n == 1 else tuple(toks[i - n:i])
                if key == SEPARATOR or (n > 1 and SEPARATOR in key):
                    continue
                bucket = self._follow[n].get(key)
                if bucket is None:
                    self._follow[n][key] = [i]
                else:
                    bucket.append(i)
        self.num_indexed = len(toks)

    def matches(self, context: Sequence[int], max_match: int, limit: int,
                local: bool = False) -> list[Match]:
        """Where the context's last n tokens occurred here, for the longest anchor order n
        that occurred (the most recent `limit` places), each with how many of the context's
        last tokens match there (at most `max_match`): longest first, then most recent.
        Only places followed by a token count (in the request's own stream, that leaves
        out the context's end itself)."""
        n_ctx = len(context)
        for n in reversed(self.anchors):
            if n > n_ctx:
                continue
            key = context[-1] if n == 1 else tuple(context[-n:])
            positions = self._follow[n].get(key)
            if positions:
                break
        else:
            return []
        toks = self.tokens
        out = []
        longest = min(max_match, n_ctx)
        for p in reversed(positions[-limit:]):
            m = n
            while m < longest and p - m - 1 >= 0 and toks[p - m - 1] == context[n_ctx - m - 1]:
                m += 1
            out.append(Match(toks, p, m, local))
        out.sort(key=lambda c: -c.length)  # stable: the most recent first among equals
        return out


class GlobalIndex:
    """Earlier requests' tokens, at most `max_tokens` of them (the newest), in two
    generations."""

    def __init__(self, anchors: Sequence[int], max_tokens: int) -> None:
        self.anchors = tuple(anchors)
        self.max_tokens = max_tokens
        self.old: SuffixIndex | None = None
        self.new = SuffixIndex(self.anchors)

    def __len__(self) -> int:
        return len(self.new) + (len(self.old) if self.old is not None else 0)

    def add(self, tokens: Sequence[int]) -> None:
        if self.max_tokens <= 0 or not tokens:
            return
        half = max(1, self.max_tokens // 2)
        tokens = list(tokens[-half:])
        if len(self.new) + len(tokens) + 1 > half:
            self.old, self.new = self.new, SuffixIndex(self.anchors)
        self.new.extend(tokens)
        self.new.extend([SEPARATOR])

    def matches(self, context: Sequence[int], max_match: int, limit: int) -> list[Match]:
        out = self.new.matches(context, max_match, limit)
        if self.old is not None:
            out += self.old.matches(context, max_match, limit)
            out.sort(key=lambda c: -c.length)
        return out


def walk(matches: list[Match], k: int, context: list[int]) -> tuple[list[int], list[Evidence]]:
    """Up to k tokens continuing the context, from `matches` (longest first), and the
    evidence for each. Where an occurrence in the context itself runs into the context's
    end, it continues with the tokens proposed so far (a repeating pattern repeats)."""
    alive = matches
    out: list[int] = []
    evidence: list[Evidence] = []
    end = len(context)
    for j in range(k):
        groups: dict[int, list[Match]] = {}
        for c in alive:
            q = c.pos + j
            if q < len(c.stream):
                t = c.stream[q]
            elif c.stream is context and q - end < len(out):
                t = out[q - end]
            else:
                continue
            if t == SEPARATOR:
                continue
            g = groups.get(t)
            if g is None:
                groups[t] = [c]
            else:
                g.append(c)
        if not groups:
            break
        n_alive = sum(len(g) for g in groups.values())
        # the first candidate of a group is its longest (then most recent) match
        token, group = max(groups.items(), key=lambda kv: (kv[1][0].length, len(kv[1])))
        best = group[0]
        evidence.append(Evidence(best.length + j, len(group), n_alive, best.local))
        out.append(token)
        alive = group
    return out, evidence
