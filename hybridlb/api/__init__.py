"""The OpenAI-compatible API server: one or more per node, over that node's engines. It
never imports torch (``hybridlb.checkpoint`` gives it the tokenizer and templates).

``http_server`` is the process and ``app`` builds its FastAPI app behind ``guard``; ``openai/``
is the HTTP surface (routes, request bodies, their answers); ``dispatch/`` is the node's
dispatcher, which runs each engine request on one of the node's engines. ``errors`` and
``spec`` lie under both."""
