"""Parity checks of a build's outputs against the float reference: the pure functions both validation and tests use.

Three modes (``conf/validate``):

- ``exact``: free-running greedy tokens identical to the reference's, EOS included (the seed's SEQ_MATCH).
- ``teacher_forced``: fed the reference's continuation, the share of steps whose argmax is the reference's token
  must reach ``teacher_forced_min``.
- ``logits``: neuronx-distributed-inference's logit matching. Fed the reference's continuation (what NxDI does
  after a divergence, here from the start), every step's logits are compared on the reference's top-k slices
  (k = 5, 50, 1000, all): a slice passes when ``max |ours - ref| <= atol + rtol * max |ref|`` over its tokens. A step
  whose argmax differs from the reference's token is an accepted divergence when the reference itself scored the
  two tokens within ``divergence_tol`` of each other.

  With ``dtype_noise`` (three-way, for bf16), a prompt that misses those fixed thresholds still passes when every
  slice error is within ``noise_multiplier`` times the error of transformers' own bf16 model on the same prompt,
  and every divergence is explained by a logit gap no larger than that model's largest top-5 error: the artifact is
  then as faithful to fp32 as bf16 itself allows.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from pipeline.validation.reference_records import DtypeNoise, SliceErrors

SLICES = tuple(f.name for f in fields(SliceErrors))
SLICE_K = {"top5": 5, "top50": 50, "top1000": 1000, "all": None}


@dataclass(frozen=True)
class StepDivergence:
    """A step whose argmax is not the reference's token, and how much higher the reference scored its own."""

    step: int
    ours: int
    reference: int
    reference_gap: float


@dataclass
class LogitErrors:
    """How far one prompt's logits are from the reference's, over all its steps."""

    relative: SliceErrors  # per slice: max over steps of max|d| / max|ref| on the slice
    absolute: SliceErrors  # per slice: max over steps of max|d|
    divergences: list[StepDivergence]
    steps: int
    matched: int  # steps whose argmax is the reference token

    @property
    def match_share(self) -> float:
        return self.matched / self.steps if self.steps else 1.0


@dataclass(frozen=True)
class LogitsVerdict:
    """The ``logits`` mode's verdict of one prompt: which route passed it (None: neither) and what failed."""

    passed: bool
    route: str | None
    failures: list[str]


def logit_errors(ours: torch.Tensor, reference: torch.Tensor, reference_tokens: list[int]) -> LogitErrors:
    """Compare ``ours`` and ``reference`` (``[steps, vocab]`` fp32), step by step, slice by slice."""
    steps = min(len(ours), len(reference), len(reference_tokens))
    ours, reference = ours[:steps].float(), reference[:steps].float()
    relative = {s: 0.0 for s in SLICES}
    absolute = {s: 0.0 for s in SLICES}
    order = reference.argsort(dim=-1, descending=True)
    for name, k in SLICE_K.items():
        idx = order if k is None else order[:, : min(k, reference.shape[-1])]
        ref = reference.gather(-1, idx)
        diff = (ours.gather(-1, idx) - ref).abs().max(dim=-1).values
        scale = ref.abs().max(dim=-1).values.clamp_min(1e-12)
        relative[name] = float((diff / scale).max()) if steps else 0.0
        absolute[name] = float(diff.max()) if steps else 0.0
    chosen = ours.argmax(dim=-1)
    divergences = []
    for step in range(steps):
        ours_token, ref_token = int(chosen[step]), int(reference_tokens[step])
        if ours_token != ref_token:
            gap = float(reference[step, ref_token] - reference[step, ours_token])
            divergences.append(StepDivergence(step, ours_token, ref_token, gap))
    return LogitErrors(SliceErrors(**relative), SliceErrors(**absolute), divergences, steps,
                       steps - len(divergences))


def slice_failures(errors: LogitErrors, reference: torch.Tensor, tol_map: dict[str, tuple[float, float]]) -> list[str]:
    """Slices whose error exceeds ``atol + rtol * max|ref|`` (checked on the relative error: atol is scaled too)."""
    scale = float(reference.abs().max()) if reference.numel() else 1.0
    failed = []
    for name, relative in errors.relative.items():
        atol, rtol = tol_map[name]
        if relative > rtol + atol / max(scale, 1e-12):
            failed.append(f"{name}: relative error {relative:.4f} > rtol {rtol}")
    return failed


def divergence_failures(errors: LogitErrors, tolerance: float) -> list[str]:
    return [f"step {d.step}: chose {d.ours} over the reference's {d.reference}, which the reference scored "
            f"{d.reference_gap:.4f} higher (> {tolerance})"
            for d in errors.divergences if d.reference_gap > tolerance]


def noise_failures(errors: LogitErrors, noise: DtypeNoise, multiplier: float) -> list[str]:
    """Three-way: is every error within ``multiplier`` x transformers' own bf16 error on this prompt?"""
    failed = []
    for (name, ours), (_, bf16) in zip(errors.relative.items(), noise.relative.items()):
        if ours > multiplier * bf16:
            failed.append(f"{name}: relative error {ours:.4f} > {multiplier} x transformers bf16 {bf16:.4f}")
    gap_bound = multiplier * noise.absolute.top5
    failed += [f"step {d.step}: divergence over a reference gap of {d.reference_gap:.4f}, larger than "
               f"transformers bf16's largest top-5 error {noise.absolute.top5:.4f}"
               for d in errors.divergences if d.reference_gap > gap_bound]
    return failed


def judge_logits(errors: LogitErrors, reference: torch.Tensor, settings, noise: DtypeNoise | None) -> LogitsVerdict:
    """The ``logits`` verdict of one prompt; ``settings`` is the ``validate.parity.logits`` section."""
    tol_map = {name: tuple(settings.tol_map[name]) for name in SLICES}
    static = slice_failures(errors, reference, tol_map) + divergence_failures(errors, settings.divergence_tol)
    if not static:
        return LogitsVerdict(True, "tolerances", [])
    if settings.dtype_noise and noise is not None:
        three_way = noise_failures(errors, noise, settings.noise_multiplier)
        if not three_way:
            return LogitsVerdict(True, "dtype_noise", static)
        return LogitsVerdict(False, None, static + three_way)
    return LogitsVerdict(False, None, static)


def logits_of(tensors: dict[str, torch.Tensor], index: int) -> torch.Tensor:
    """Prompt ``index``'s reference logits ``[steps, vocab]`` from reference.safetensors (written by the reference
    stage): fp16 everywhere, exact fp32 on the top-k."""
    full = tensors[f"{index}.logits"].float()
    return full.scatter(-1, tensors[f"{index}.topk_indices"].long(), tensors[f"{index}.topk_values"])
