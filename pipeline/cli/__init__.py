"""The subcommands of ``python -m pipeline``: pull, generate, schedule, check-upgrades and neuron-check.
"""
