"""Benchmarks and the main job (``hopq bench ...``, ``hopq train``)."""
