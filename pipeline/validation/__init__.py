"""Validating a build: the fresh-process worker, greedy generation on the loaded ranks, the parity judges, and the
prompts.
"""
