"""Test stand-in for neuronx-cc's Python package: only its version (see tests/fake_neuron/README.md).

FAKE_NEURONX_CC_VERSION lets a test simulate a compiler upgrade.
"""

import os

__version__ = os.environ.get("FAKE_NEURONX_CC_VERSION", "9.9.9.9+fa4e0000")
