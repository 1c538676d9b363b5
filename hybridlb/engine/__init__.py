"""The engine: one process per data-parallel rank.

``EngineCore`` is the plain-object engine (scheduler, block manager, model runner,
sampler) with no I/O; ``hybridlb.engine.process`` is the thin ZMQ shell around it and
``hybridlb.engine.client`` is how front ends talk to that shell.
"""
