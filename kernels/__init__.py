"""llmserve's Triton kernels (paged attention, KV store, fused layer kernels).

Not the unrelated PyPI package of the same name; `tests/test_layout.py` checks which one is
imported.
"""
