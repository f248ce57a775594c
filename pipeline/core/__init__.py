"""The bottom layer: errors, logging, atomic files and records, package versions, units, and the build shape.

Imports nothing else of the pipeline and nothing heavy (no torch): everything above reads it.
"""
