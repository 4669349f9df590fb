"""Running a model: where weights come from (registry, loader), the model families
(models/), the paged KV cache and its quantized forms, attention over it, the model runner
that turns a scheduled batch into one forward pass, and the sampler."""
