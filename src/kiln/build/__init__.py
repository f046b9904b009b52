"""kiln build: turn a model into an optimized, verified engine folder ready to load or serve."""
