"""This machine: the preflight (RAM + swap, disk, NeuronCores), process information, and the locks several runs
sharing one artifacts folder hold.
"""
