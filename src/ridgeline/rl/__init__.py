"""Asynchronous agentic RL post-training: rollouts, buffer, advantages, losses, trainer."""
