"""What a Neuron compile is handed, shared by the backend that compiles it and the one that lowers it on the CPU.

The neuron backend compiles ``AliasedRank`` with neuronx-distributed (pipeline/backends/neuron_rank.py); the xla
backend lowers the same module with torch-xla, the front end torch-neuronx compiles from, to show what neuronx-cc
would receive (pipeline/backends/xla_rank.py). Both refuse the same shapes (``shape_problems``). Imports no Neuron
package and no other backend: the two use it as peers.
"""

from __future__ import annotations

from torch import nn

from pipeline.core.shape import BuildShape


def shape_problems(shape: BuildShape) -> list[str]:
    """What a Neuron compile refuses beyond the generic checks."""
    found = []
    if shape.prefill == "device" and shape.bucket < 2:
        found.append(f"variant.bucket={shape.bucket} with prefill=device: neuronx-distributed routes prefill and "
                     "decode calls by their input shapes, so a prefill bucket must hold at least 2 tokens")
    elif shape.smaller_buckets and shape.smaller_buckets[0] < 2:
        found.append(f"variant.smaller_buckets={list(shape.smaller_buckets)}: neuronx-distributed routes prefill and "
                     "decode calls by their input shapes, so a prefill bucket must hold at least 2 tokens")
    return found


class AliasedRank(nn.Module):
    """A rank whose KV caches are graph state: ``forward`` returns ``(logits, *caches)``, and ``aliases()`` maps each
    cache parameter to its output index, so the runtime writes the updated caches back into the same device memory.

    Logits are fp32 ``[rows, vocab]``; the greedy token is taken on the host (one argmax), so no integer output leaves
    the graph. ``entry`` is the graph being traced (``prefill`` or ``decode``), which fixes how many sequences a call
    runs (pipeline/recipe/model.py ``entry_rows``): ModelBuilder builds one module per key, the xla backend sets it
    before lowering each. At batch above 1 ``forward`` takes ``seq_ids`` as its fifth input.
    """

    def __init__(self, decoder, entry: str = "decode"):
        super().__init__()
        for name in decoder.cache_names():
            cache = getattr(decoder, name)
            delattr(decoder, name)  # a buffer becomes a parameter: neuronx-distributed aliases parameters only
            decoder.register_parameter(name, nn.Parameter(cache, requires_grad=False))
        self.decoder = decoder
        self.entry = entry

    def forward(self, embeds, per_layer_tokens, positions, last_index, seq_ids=None):
        from pipeline.recipe.model import entry_rows

        logits, _token, caches = self.decoder.step(embeds, per_layer_tokens, positions, last_index, seq_ids,
                                                   entry_rows(self.decoder, self.entry))
        return (logits, *caches)

    def caches(self) -> list[nn.Parameter]:
        return self.decoder.caches()

    def aliases(self) -> dict[nn.Parameter, int]:
        """``{cache parameter: output index}``; output 0 is the logits."""
        return {cache: 1 + j for j, cache in enumerate(self.caches())}
