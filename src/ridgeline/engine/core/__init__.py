"""The engine core: the step loop (`LLMEngine`: schedule -> execute -> sample -> update ->
outputs), the scheduler and its block manager (KV slots, prefix cache, preemption), output
processing and detokenization, and the worker thread that steps a shared engine."""
