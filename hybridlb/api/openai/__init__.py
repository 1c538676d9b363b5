"""The OpenAI surface of the API server: ``routes``; the request bodies (``schemas``,
``chat_schemas``) and what they ask of the engines (``structured``, ``chat_tools``); ``jobs``
turns a body into engine requests and ``responses`` answers with their output (``chat_output``,
``reasoning``, ``tools/``, ``logprobs``); ``tokenize`` and ``lora_routes`` are the rest of
vLLM's endpoints. Its routes work with an ``ApiContext`` (``context``)."""
