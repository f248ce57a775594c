"""What one rank of a neuron build holds in its NeuronCore's device memory, estimated from the checkpoint's spec and
the variant before anything is compiled, and the refusal of a variant that cannot fit.

A NeuronCore-v2 of an inf2 host has 16 GiB of HBM (one Inferentia2 chip: 32 GiB and two NeuronCore-v2; Neuron docs,
about-neuron/arch/neuron-hardware/inferentia2.rst and libraries/nxd-inference/developer_guides/feature-guide.rst "each
Neuron core has 16GB of memory", at v2.28.0). Of one rank's share this counts:

- ``weights``: the rank's tensors at the variant's dtype (``ShardPlan.rank_bytes``, what the rank files hold). Both of
  a device-prefill build's graphs (ModelBuilder's ``prefill`` and ``decode`` keys) share one weight set: ModelBuilder
  compiles them with ``inline_weights_to_neff=False`` and loads the weights once (NxD v2.28.0
  trace/model_builder.py ~889-896). Separate graphs each embedding their weights are what the seed recipe found does
  not fit E4B ("~15.4 GB of fp32 model constants, and a second neff on the same core tips it past the 16 GB
  NeuronCore budget"): the recipe never builds those.
- ``kv``: the rank's KV caches (a producer layer's keys and values, its KV heads over the ranks, ``kv_max`` positions,
  ``batch_size`` sequences: NxDI's ``batch x layers x positions x kv width x 2 x dtype``,
  about-neuron/transformers/generative-llm-inference-with-neuron.rst).
- ``scratch``: the largest graph's live activations (the runtime sizes one shared scratchpad to the largest of the
  graphs loaded on a core: neuron-runtime/explore/device-memory.rst): one decoder layer at a time, bounded from above
  (every intermediate of the layer at once, fp32, the one-hot cache write's full-size temporaries of every cache line
  included), twice. A decode step runs ``batch_size`` rows; a prefill runs one sequence's bucket, but its write and
  its line's view touch every line.
- ``programs``: each graph's instructions and DMA descriptors, ``PROGRAM_BYTES`` each (not published; a guess that
  hardware must confirm), and ``RUNTIME_RESERVE`` for the runtime's micro-code (96 MB per core, device-memory.rst),
  collectives buffers and a scratchpad page's rounding (512 MB pages).

Only hardware can show the real figures (the runtime prints a table per NEFF when an allocation fails, and
``neuron-top`` shows the use): docs/inf2-host.md's first-run checklist says how to record them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from pipeline.core.shape import BuildShape
from pipeline.core.units import GIB
from pipeline.recipe.spec import ModelSpec

MIB = 1 << 20
NEURONCORE_V2_HBM = 16 * GIB
RUNTIME_RESERVE = 96 * MIB + 512 * MIB + 512 * MIB  # micro-code, a scratchpad page's rounding, rings and collectives
PROGRAM_BYTES = 512 * MIB  # per compiled graph (UNVERIFIED: no published figure)
FP32 = 4


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes one rank places on its NeuronCore."""

    weights: int
    kv: int
    scratch: int
    programs: int
    reserve: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.scratch + self.programs + self.reserve

    def record(self) -> dict:
        """For build.json: each part and the total, in GiB, against the core's HBM."""
        parts = {k: round(v / GIB, 3) for k, v in asdict(self).items()}
        return {**parts, "total": round(self.total / GIB, 3), "neuroncore_hbm": round(NEURONCORE_V2_HBM / GIB, 3)}

    def describe(self) -> str:
        return (f"{self.total / GIB:.1f} GiB: weights {self.weights / GIB:.2f}, KV caches {self.kv / GIB:.2f}, "
                f"activations {self.scratch / GIB:.2f}, programs {self.programs / GIB:.2f}, runtime "
                f"{self.reserve / GIB:.2f}")


def kv_bytes(spec: ModelSpec, shape: BuildShape) -> int:
    """The rank's caches (``ShardPlan.rank_kv_bytes``: every line, at the variant's dtype)."""
    from pipeline.recipe.plan import ShardPlan

    return ShardPlan(spec, shape.tp_degree).rank_kv_bytes(shape.kv_max, shape.batch_size, shape.torch_dtype)


def layer_activations(spec: ModelSpec, shape: BuildShape, tokens: int, rows: int = 1) -> int:
    """An upper bound of one decoder layer's live intermediates for a call of ``tokens`` tokens of ``rows``
    sequences, on one rank (fp32: the residual stream, norms and softmax are fp32 in the recipe; the matmuls' outputs
    counted at fp32 too)."""
    from pipeline.recipe.plan import rank_kv_heads

    tp, h, heads = shape.tp_degree, spec.hidden_size, spec.num_heads // shape.tp_degree
    item, lines, n = shape.torch_dtype.itemsize, shape.batch_size, rows * tokens
    worst = 0
    for layer in spec.layers:
        kv_heads, d = rank_kv_heads(layer.num_kv_heads, tp), layer.head_dim  # a copied head counted on each rank
        residual = 6 * n * h * FP32  # the stream, its norms, the attention and MLP outputs, the sum
        attention = (n * heads * d * FP32 * 3  # q, rotated q, the attention's output
                     + 2 * heads * n * shape.kv_max * FP32  # scores and probabilities over every slot
                     + 2 * n * kv_heads * d * FP32)  # this call's keys and values
        # buf * (1 - onehot) + k * onehot over every line, keys and values; a batch's prefill also views its line
        temporaries = 6 + (2 if shape.batched and rows == 1 else 0)
        cache_write = temporaries * lines * kv_heads * shape.kv_max * d * item
        mlp = 3 * n * (layer.intermediate_size // tp) * FP32  # gate, up, their product
        per_layer = n * spec.num_layers * max(spec.ple_dim, 1) * FP32
        worst = max(worst, residual + attention + cache_write + mlp + per_layer)
    logits = rows * spec.vocab_size * FP32 * 2  # each row's selected position's logits, before and after the softcap
    return worst + logits


def estimate(spec: ModelSpec, shape: BuildShape) -> DeviceMemory:
    """One rank's device memory for ``shape`` of the model ``spec`` describes (every graph of device prefill, a
    prefill graph per bucket of the ladder and decode; the decode graph of host prefill)."""
    from pipeline.recipe.plan import ShardPlan

    calls = [(1, shape.batch_size)] + [(tokens, 1) for tokens in shape.prefill_buckets]  # a graph each
    return DeviceMemory(weights=ShardPlan(spec, shape.tp_degree).rank_bytes(shape.torch_dtype),
                        kv=kv_bytes(spec, shape),
                        scratch=2 * max(layer_activations(spec, shape, tokens, rows) for tokens, rows in calls),
                        programs=PROGRAM_BYTES * len(calls), reserve=RUNTIME_RESERVE)


def largest_batch(spec: ModelSpec, shape: BuildShape) -> int:
    """The most sequences ``shape`` could decode at once and still fit one NeuronCore-v2 per rank (0: not even one)."""
    from dataclasses import replace

    fits = [b for b in range(1, max(shape.batch_size, 1) + 1)
            if estimate(spec, replace(shape.shape, batch_size=b)).total <= NEURONCORE_V2_HBM]
    return max(fits, default=0)


def fit_problem(spec: ModelSpec, shape: BuildShape) -> str | None:
    """Why ``shape`` cannot fit one NeuronCore-v2 per rank (None when it can), naming the settings that shrink it."""
    need = estimate(spec, shape)
    if need.total <= NEURONCORE_V2_HBM:
        return None
    knobs = []
    if shape.batched:
        fits = largest_batch(spec, shape)
        knobs.append(f"variant.batch_size={fits} (the most sequences that fit; the caches grow with each)" if fits
                     else f"a smaller variant.batch_size than {shape.batch_size} (even one sequence does not fit)")
    if need.weights > NEURONCORE_V2_HBM / 2:
        if shape.dtype == "fp32":
            knobs.append("variant.dtype=bf16 (halves the weights)")
        knobs.append(f"a larger variant.tp_degree than {shape.tp_degree} (the weights split over more cores)")
    if need.kv + need.scratch > NEURONCORE_V2_HBM / 4:
        knobs.append(f"a smaller variant.kv_max than {shape.kv_max} (the caches and attention grow with it)")
        if shape.prefill == "device":
            knobs.append(f"a smaller variant.bucket than {shape.bucket} (a prefill call's activations grow with it)")
    batch = f", batch_size {shape.batch_size}" if shape.batched else ""
    return (f"{shape.kv_max}/{shape.bucket} {shape.dtype} {shape.prefill}-prefill at tp_degree {shape.tp_degree}{batch}"
            f" needs about {need.describe()} per NeuronCore, more than a NeuronCore-v2's "
            f"{NEURONCORE_V2_HBM / GIB:.0f} GiB of device memory (pipeline/backends/neuron_memory.py): choose "
            + (" or ".join(knobs) if knobs else "a smaller variant") + ". Nothing was compiled")
