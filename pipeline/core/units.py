"""Sizes and NeuronCore ranges as people write them in settings (``64G``, ``"0-1"``), parsed in one place."""

from __future__ import annotations

GIB = 1 << 30


def parse_size(text: str) -> int:
    """``64G`` / ``512M`` / ``1.5T`` as bytes."""
    text = text.strip().upper().removesuffix("B").removesuffix("I")
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def parse_cores(spec: str) -> list[int]:
    """``"2-3"`` -> [2, 3]; ``"0,1"`` -> [0, 1]; the forms ``NEURON_RT_VISIBLE_CORES`` takes. ValueError otherwise."""
    cores: list[int] = []
    for part in str(spec).replace(" ", "").split(","):
        first, sep, last = part.partition("-")
        if not first.isdigit() or (sep and not last.isdigit()):
            raise ValueError(f"{spec!r} is not a core range like '0-1' or a list like '0,1'")
        lo, hi = int(first), int(last) if sep else int(first)
        if hi < lo:
            raise ValueError(f"{spec!r}: the range {part} runs backwards")
        cores += range(lo, hi + 1)
    if len(set(cores)) != len(cores):
        raise ValueError(f"{spec!r} names a core twice")
    return sorted(cores)


def format_cores(cores: list[int]) -> str:
    """The ``NEURON_RT_VISIBLE_CORES`` form: a range when contiguous, else a list."""
    if cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}" if len(cores) > 1 else str(cores[0])
    return ",".join(map(str, cores))


def visible_cores_problems(spec: str | None, tp_degree: int, host_cores: int | None) -> list[str]:
    """What is wrong with ``backend.visible_cores`` for this variant and host (empty when nothing is)."""
    if spec is None:
        return []
    try:
        cores = parse_cores(spec)
    except ValueError as exc:
        return [f"backend.visible_cores={spec!r}: {exc}"]
    found = []
    if len(cores) != tp_degree:
        found.append(f"backend.visible_cores={spec!r} names {len(cores)} NeuronCore(s) but variant.tp_degree is "
                     f"{tp_degree}: name exactly {tp_degree} (e.g. '0-{tp_degree - 1}'), or unset it to pick free ones")
    if host_cores is not None and cores and cores[-1] >= host_cores:
        have = f"0-{host_cores - 1}" if host_cores > 1 else ("0" if host_cores else "none")
        found.append(f"backend.visible_cores={spec!r} names NeuronCores this host does not have (it has "
                     f"{host_cores}: {have}, per neuron-ls): choose cores within that range, or unset it")
    return found
