"""One step: set-up and memory profiling, plan arrays to tensors, forward, sample; the KV tensors, the loader, CUDA graphs."""
