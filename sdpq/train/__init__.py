"""Application layer: a small GPT, real text data and the training loop shared by the demo,
the benchmarks and the integration tests. Nothing in the library layers imports this."""
