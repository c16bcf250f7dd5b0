"""Inference: tiny offline policies and the generation engines (vLLM, torch reference)."""
