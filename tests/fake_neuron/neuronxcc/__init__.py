"""Test stand-in for neuronx-cc's Python package: only its version, with a build hash as the real one carries
(``2.23.6484.0+f702b353``), from the dist-info tests/fake_sdk.py writes."""

import importlib.metadata

__version__ = importlib.metadata.version("neuronx-cc")
