"""A deterministic OpenAI-compatible inference backend that stands in for vLLM in tests and the demo.

Run it with ``python examples/fake_backend/server.py --port N`` (or ``python -m
examples.fake_backend.server`` from the repository root). See ``server.py`` for its routes.
"""
