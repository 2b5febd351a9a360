"""Multi-GPU execution: expert parallelism with data-parallel attention (``ep.py``)."""
