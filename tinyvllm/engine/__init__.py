"""The engine: request state, paged-KV bookkeeping, scheduling and the step loop."""
