"""Benchmark clients shipped with hybridlb (``hybridlb bench ...``)."""
