"""Test stand-in for neuronx-cc's Python package: only its version, with a build hash as the real one carries
(``2.23.6484.0+f702b353``); the release comes from the dist-info tests/fake_sdk.py writes."""

import hashlib
import importlib.metadata

_release = importlib.metadata.version("neuronx-cc")
__version__ = f"{_release}+{hashlib.sha256(_release.encode()).hexdigest()[:8]}"
