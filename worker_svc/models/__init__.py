"""The model families the worker runs: one module per family over shared layers.

registry.py  config.json's `architectures` -> family; build_model, model_shape
shape.py     ModelShape: the numbers and switches a family's config turns into
decoder.py   the shared layers (attention, gated MLP, pre-norm and sandwich layers, LM head)
llama.py     Llama 2/3, Mistral, Qwen2, SmolLM2
qwen3.py     Qwen3 (dense)
gemma.py     Gemma 2, Gemma 3 (text)
"""
