"""Engine adapters: one per training engine, each yielding full tensors for what this rank writes and taking
back what this rank needs. They share the `EngineAdapter` protocol in `base`."""
