"""kvcr: a router-aware distributed KV-cache reuse service for LLM serving."""

__version__ = "0.1.0"
