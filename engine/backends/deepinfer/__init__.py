"""DeepInfer as an engine backend (SM100 / Ascend 950; nothing of it imports on other machines).

Modules: ``sampling`` (deepserve's SamplingParams → DeepInfer's, refusing what it lacks),
``layout`` (DeepInfer's KV cache byte layout from a V4.1 config: ``worker/cache_engine.py``'s
arithmetic), ``records`` (block rows → block records, stored windows → snapshot records, the PD
hand-off record), ``bridge`` (what the hooks do with deepserve's store and events), ``engines``
(the ``LLMEngine`` subclass per role), ``backend`` (one DP rank as an ``EngineBackend``),
``factory`` (the registry's entry: the only module that imports ``deepinfer``).
See docs/DEEPINFER.md.
"""
