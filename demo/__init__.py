"""The built-in demo model (trained on first use, then cached) and config-only model
folders for benchmarks. Outside the engine: the command line and `LLM` resolve "demo" to
a folder; the engine loads folders only."""
