"""The code that makes each backend's rank files, as paths under pipeline/ (files or folders).

Read by the trace stage (a version's inputs digest hashes it: only an edit here can make other bytes) and by the xla
backend (its rank files hold weights, not code: a loaded rank must still be built by the code that built it). What
runs to make the files' bytes, and for xla to rebuild a loaded rank: the shape, the recipe, the backend's own modules
and the module neuron and xla share (``aliased_rank.py``, the graphs a Neuron compile is handed). Not the rank runtime
(``ranks.py``): it carries jobs and tensors between processes and decides no byte, so a fix there renames nothing.
"""

BUILD_CODE = {
    "cpu": ("core/shape.py", "recipe", "backends/base.py", "backends/torchscript.py", "backends/cpu.py"),
    "neuron": ("core/shape.py", "recipe", "backends/base.py", "backends/torchscript.py", "backends/aliased_rank.py",
               "backends/neuron.py", "backends/neuron_rank.py"),
    "xla": ("core/shape.py", "recipe", "backends/base.py", "backends/aliased_rank.py", "backends/hlo.py",
            "backends/neuronx_cc_xla_operators.py", "backends/xla.py", "backends/xla_rank.py"),
}
