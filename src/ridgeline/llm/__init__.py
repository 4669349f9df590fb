"""Model clients behind one protocol: in-process engine or any OpenAI-compatible server."""

from ridgeline.llm.base import ChatModel, Completion, Message, Sampling, ToolCall, ToolSpec, Usage

__all__ = ["ChatModel", "Completion", "Message", "Sampling", "ToolCall", "ToolSpec", "Usage"]
