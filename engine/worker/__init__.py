"""The device side of an engine: the model runner, tensor-parallel ranks, CUDA graphs,
memory profiling and KV pool sizing, and the KV staging and handoff of a prefill."""
