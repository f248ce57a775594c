"""Build pipeline that turns Gemma-4 checkpoints into versioned, validated Neuron artifacts.

Run it as ``python -m pipeline +variant=NAME``; see README.md.
"""

__version__ = "0.1.0"
