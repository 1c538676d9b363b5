"""The harness tests and benchmarks share: real server process trees (hybridlb's or a peer's)
started, waited for and stopped by pid, free ports, process-tree measurements, and builders of
the models, adapters and GGUF files they serve. Nothing here is imported by a server."""
