"""LLM serving: continuous batching over a server-owned KV cache (see engine.py)."""
