"""The reference backend: deepserve's own PyTorch engine (``EngineCore``) behind the backend interface."""
