"""What several test folders share: tiny engine models and tokenizers, scripted models,
sandbox checks, and the Redis, PostgreSQL and OpenAI-compatible servers tests
start on loopback."""
