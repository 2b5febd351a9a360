"""The DeepSeek-V4.1 model family (``DeepseekV41ForCausalLM``), next to V4.

Module map: ``config.py`` (``V41Config`` from ``config.json``), ``quant.py`` (the FP8/FP4
fake-quantisation of the KV caches), ``engram.py`` (n-gram hash memory), ``state.py`` (one
sequence's cached state), ``attention.py`` (window + shared compressed KV attention, compressor,
indexer), ``model.py`` (single-pass mHC decoder layers, the causal LM), ``loader.py``
(checkpoint names and tensors).
"""
