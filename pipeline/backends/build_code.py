"""The code that makes each backend's rank files, as paths under pipeline/ (files or folders).

Read by the trace stage (a version's inputs digest hashes it: only an edit here can make other bytes) and by the xla
backend (its rank files hold weights, not code: a loaded rank must still be built by the code that built it). Each
backend's own modules are listed under it alone; a module two backends share (the rank runtime, the graphs a Neuron
compile is handed) is listed under both, and no backend's own module imports another's (tests/test_layers.py).
"""

BUILD_CODE = {
    "cpu": ("core/shape.py", "recipe", "backends/base.py", "backends/torchscript.py", "backends/ranks.py",
            "backends/cpu.py"),
    "neuron": ("core/shape.py", "recipe", "backends/base.py", "backends/torchscript.py", "backends/neuron_graphs.py",
               "backends/neuron.py", "backends/neuron_rank.py"),
    "xla": ("core/shape.py", "recipe", "backends/base.py", "backends/ranks.py", "backends/neuron_graphs.py",
            "backends/hlo.py", "backends/neuronx_cc_xla_operators.py", "backends/xla.py", "backends/xla_rank.py"),
}
