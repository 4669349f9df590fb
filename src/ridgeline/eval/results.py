"""Per-episode results and the summary an evaluation reports.

They live in `ridgeline.agent.results`, shared with the held-out evaluation of a training
run (which may not import `eval`, beside it): see there for the scoring rule (infra errors
and unsupported tasks are never scored) and the 95% bootstrap interval of pass@1.
"""

from __future__ import annotations

from ridgeline.agent.results import (
    MODEL_ERROR, EpisodeResult, Summary, bootstrap_ci, pass_at_k, summarize, summary_json,
)

__all__ = ["MODEL_ERROR", "EpisodeResult", "Summary", "bootstrap_ci", "pass_at_k",
           "summarize", "summary_json"]
