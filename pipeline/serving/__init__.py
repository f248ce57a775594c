"""Serving a published build: the decode engine (engine.py) and the OpenAI-compatible HTTP routes (routes.py)."""
