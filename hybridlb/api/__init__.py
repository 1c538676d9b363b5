"""The OpenAI-compatible API server: one or more per node, over that node's engines."""
