"""myria: 4D-parallel LLM pre-training that plans, explains and survives runs at scale."""

__version__ = "0.1.0"
