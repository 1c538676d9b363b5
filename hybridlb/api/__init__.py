"""The OpenAI-compatible API server: one or more per node, over that node's engines. It
never imports torch (``hybridlb.checkpoint`` gives it the tokenizer and templates).

``http_server`` is the process; ``app`` builds the FastAPI app; ``routes`` are its
routes; ``jobs`` turns a body into engine requests and ``responses`` answers with their
output; ``runner`` runs one engine request; ``pool`` picks the engine (``balance``)."""
