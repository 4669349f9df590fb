"""Speculative decoding: proposers (n-gram lookup with suffix indexes, a draft model, draft
heads), the cost model that sizes proposals, acceptance estimates, rejection sampling and
the `Speculator` the engine steps with. Draft-head training is engine/draft_training.py."""
