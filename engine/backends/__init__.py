"""Engine backends: one interface (``base.EngineBackend``), a registry (``registry``), and the
implementations: ``reference`` (deepserve's own engine) and ``deepinfer`` (DeepInfer's
``LLMEngine`` with its empty hooks filled by deepserve's KV store, PD hand-off and events)."""
