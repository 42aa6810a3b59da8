"""rollart: disaggregated, staleness-bounded agentic RL training for LLMs."""

__version__ = "0.1.0"
