"""The code that makes each backend's rank files, as paths under pipeline/ (files or folders).

Read by the trace stage (a version's inputs digest hashes it: only an edit here can make other bytes) and by the xla
backend (its rank files hold weights, not code: a loaded rank must still be built by the code that built it).
"""

BUILD_CODE = {
    "cpu": ("core/shape.py", "recipe", "backends/base.py", "backends/torchscript.py", "backends/cpu.py"),
    "neuron": ("core/shape.py", "recipe", "backends/base.py", "backends/torchscript.py", "backends/neuron.py",
               "backends/neuron_rank.py"),
    "xla": ("core/shape.py", "recipe", "backends/base.py", "backends/cpu.py", "backends/neuron_rank.py",
            "backends/hlo.py", "backends/neuronx_cc_xla_operators.py", "backends/xla.py", "backends/xla_rank.py"),
}
