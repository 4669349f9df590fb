"""Conflict detection between task domains: every `every` steps, the gradient of each
domain's share of the batch is computed on its own and the cosine similarity of every
pair is recorded. Domains whose gradients point apart (cosine below `threshold`) in
`persist` measurements in a row are *in conflict*: learning one undoes the other. A
conflict is flagged in the step metrics (`conflict/A|B` is the cosine, `conflicts` the
number of flagged pairs) and in the run report; with `reweight` the domain of the pair
that passes more often (it has less left to learn) gets its sampling weight scaled by
`reweight_factor`, once per flagged pair.

Multi-task RL papers measure the same thing (gradient surgery, PCGrad); here it is a
monitor, not a change to the update: the step itself is unchanged.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypedDict

import torch
from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from ridgeline.rl.protocols import Trainer
    from ridgeline.rl.tokens import TokenBatch


class ConflictConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    every: int = Field(0, ge=0, description="measure every N train steps (0: never)")
    threshold: float = Field(-0.05, ge=-1, le=1, description="a cosine below this is a "
                             "negative measurement")
    persist: int = Field(3, ge=1, description="negative measurements in a row that flag a "
                         "pair")
    min_episodes: int = Field(2, ge=1, description="episodes a domain needs in the batch")
    reweight: bool = Field(False, description="scale down the sampling weight of the "
                           "more-solved domain of a flagged pair")
    reweight_factor: float = Field(0.5, gt=0, le=1)


class _FlaggedRequired(TypedDict):
    step: int
    cosine: float
    domains: list[str]
    reweighted: str | None      # the domain to sample less (with `reweight`)


class FlaggedPair(_FlaggedRequired, total=False):
    """A pair of domains in conflict: when and how it was flagged."""

    applied: bool               # its reweighting was handed out


class Measurement(TypedDict):
    """One measurement: the step and every pair's cosine."""

    step: int
    cosines: dict[str, float]


class ConflictReport(TypedDict):
    """The run report's `conflicts`."""

    flagged: dict[str, FlaggedPair]
    measurements: int
    last: Measurement | None


class ConflictState(TypedDict, total=False):
    """`ConflictMonitor.state_dict()` (both keys optional when loading)."""

    streak: dict[str, int]
    flagged: dict[str, FlaggedPair]


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    na, nb = float(a.norm()), float(b.norm())
    if na == 0.0 or nb == 0.0:
        return 0.0
    return float(torch.dot(a, b)) / (na * nb)


def pair_name(a: str, b: str) -> str:
    return f"{a}|{b}"


class ConflictMonitor:
    """Measures the domains' gradient cosines when due and flags persistent conflicts."""

    def __init__(self, config: ConflictConfig | None = None) -> None:
        self.config = config or ConflictConfig()
        self.streak: dict[str, int] = {}
        self.flagged: dict[str, FlaggedPair] = {}
        self.history: list[Measurement] = []

    def due(self, step: int) -> bool:
        return self.config.every > 0 and step % self.config.every == 0

    def measure(self, step: int, trainer: Trainer, batch: TokenBatch, domains: Sequence[str],
                pass_rates: dict[str, float] | None = None) -> dict[str, float]:
        """Per-domain gradients of `batch` (row i belongs to `domains[i]`), their pairwise
        cosines, and the flags; returns step metrics."""
        cfg = self.config
        rows: dict[str, list[int]] = {}
        for i, d in enumerate(domains):
            rows.setdefault(d, []).append(i)
        grads = {d: trainer.gradient(batch.rows(idx)) for d, idx in sorted(rows.items())
                 if len(idx) >= cfg.min_episodes and float(batch.rows(idx).loss_mask.sum()) > 0
                 and bool((batch.advantages[idx] != 0).any())}
        out: dict[str, float] = {}
        record: Measurement = {"step": step, "cosines": {}}
        for a, b in itertools.combinations(sorted(grads), 2):
            name = pair_name(a, b)
            c = cosine(grads[a], grads[b])
            out[f"conflict/{name}"] = c
            record["cosines"][name] = c
            self.streak[name] = self.streak.get(name, 0) + 1 if c < cfg.threshold else 0
            if self.streak[name] >= cfg.persist and name not in self.flagged:
                worse = None
                if pass_rates and a in pass_rates and b in pass_rates:
                    worse = a if pass_rates[a] >= pass_rates[b] else b
                self.flagged[name] = {"step": step, "cosine": c, "domains": [a, b],
                                      "reweighted": worse if cfg.reweight else None}
        self.history.append(record)
        out["conflicts"] = float(len(self.flagged))
        return out

    def to_reweight(self) -> list[str]:
        """Domains to scale down (each flagged pair's once), then forgotten."""
        out = []
        for info in self.flagged.values():
            d = info.get("reweighted")
            if d and not info.get("applied"):
                info["applied"] = True
                out.append(d)
        return out

    def report(self) -> ConflictReport:
        return {"flagged": self.flagged, "measurements": len(self.history),
                "last": self.history[-1] if self.history else None}

    def state_dict(self) -> ConflictState:
        return {"streak": dict(self.streak), "flagged": dict(self.flagged)}

    def load_state_dict(self, state: ConflictState) -> None:
        self.streak = {k: int(v) for k, v in state.get("streak", {}).items()}
        self.flagged = dict(state.get("flagged", {}))
