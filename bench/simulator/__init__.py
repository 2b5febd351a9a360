"""Trace-driven discrete-event simulator of the router and its worker pools (``deepserve simulate``)."""
