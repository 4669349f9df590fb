"""The agent platform: a gateway over model servers, durable agent tasks through a queue,
workers that checkpoint every step, results by webhook and stream, a tools registry, memory
and permission-isolated RAG, and metrics. Embedded defaults on one machine (SQLite, Qdrant
local mode); Redis and a Qdrant server at scale behind the same interfaces."""
