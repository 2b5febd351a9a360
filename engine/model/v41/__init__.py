"""The DeepSeek-V4.1 model family (``DeepseekV41ForCausalLM``), next to V4.

Module map: ``config.py`` (``V41Config`` from ``config.json``, flat or composite), ``quant.py``
(the FP8/FP4 fake quantisation of the KV caches), ``engram.py`` (n-gram hash memory over the
checkpoint tokenizer's compressed vocabulary), ``state.py`` (one sequence's cached state and its
byte accounting), ``layers.py`` (norms, mHC, MoE in the reference's operation order),
``attention.py`` (window + shared compressed KV attention, compressor, indexer), ``model.py``
(the causal LM over sequence chunks), ``loader.py`` (checkpoint names and tensors), ``tiny.py``
(the ``tiny-v41`` random checkpoint). The engine selects the family from ``config.json``'s
``model_type`` (``engine.runtime.builder.load_any_model``).
"""
