"""Versioned weights, from the trainer's step to the inference worker's reload.

Importing the package imports nothing heavy: torch and vLLM are imported by the modules that
need them (``collective``, ``vllm_engines``, ``vllm_ext``), so tools can import the rest.
"""
