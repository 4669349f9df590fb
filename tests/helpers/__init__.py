"""What several test folders share: tiny engine models and tokenizers, scripted models,
sandbox checks, and the Redis, PostgreSQL, OpenAI-compatible and browser servers tests
start on loopback."""
