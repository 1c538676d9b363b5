"""The engine: one process per data-parallel rank (torch; the API server never imports it).

``core.EngineCore`` is the plain-object engine (scheduler, block manager, model runner,
sampler) with no I/O, and ``core.make_core`` builds the one a config asks for;
``shell.EngineShell`` is the thin ZMQ shell around it (the busy loop), ``spawn`` starts
engine processes, and ``client.EngineClient`` is a synchronous front end for tools and
tests. Expert parallelism across ranks (``expert_parallel``, ``lockstep``) lives here too.
"""
