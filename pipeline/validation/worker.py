"""Validation of a packaged build, run in a fresh interpreter through the path a server would use.

``python -m pipeline.validation.worker JOB.json RESULT.json``: verify the archive against its manifest, unpack it safely
into a new directory, load the ranks with the backend's own loader, decode the validation prompts and judge them against
the reference (``pipeline/validation/parity.py``), then measure throughput. Nothing is loaded before the archive and
every member match the manifest. The result (metrics and a report a person can act on) is written to RESULT.json
(``WorkerResult``, pipeline/validation/records.py); the stage process applies the gates. A failure is written there too
(its error class and message), and the stage raises it again as the same class.

Logs one line per prompt (its verdict) and per throughput context as each is done. Started by the stage, it writes
its records to the stage (``PIPELINE_LOG_RELAY``, pipeline/core/log.py), which logs them as its own.
"""

from __future__ import annotations

import gc
import json
import shutil
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import torch

from pipeline.artifact.archive import extract_verified
from pipeline.artifact.manifest import Manifest
from pipeline.backends import get_backend
from pipeline.config import ParityConfig, ThroughputConfig, section
from pipeline.core.errors import ErrorRecord, InputError, PipelineError, StaleInputError
from pipeline.core.fsutil import reporting_full_disk, sha256_file, temp_dir_beside
from pipeline.core.log import log, setup
from pipeline.core.shape import BuildShape
from pipeline.host import bf16_matmul
from pipeline.host.procinfo import die_with_parent, peak_rss_bytes
from pipeline.validation.batch import measure_concurrency, percentile, together
from pipeline.validation.generation import Generation, Generator
from pipeline.validation.parity import judge_logits, logit_errors, logits_of
from pipeline.validation.records import (
    BatchParity,
    Bf16Matmuls,
    ContextFigures,
    Costs,
    Coverage,
    Divergence,
    Measured,
    ParitySummary,
    PeakRss,
    PromptVerdict,
    ThroughputSummary,
    TopToken,
    WorkerResult,
)
from pipeline.validation.reference_records import DtypeNoise, Prompt, ReferencePrompt, ReferenceRecord

CONTEXT = 12  # tokens shown either side of a divergence in the failure report
TOP_SHOWN = 5


def applicable(prompts: Sequence[Prompt], shape: BuildShape, max_new_tokens: int) -> list[int]:
    """Indices of the reference prompts this variant can serve (prompt plus new tokens within kv_max)."""
    return [i for i, p in enumerate(prompts) if len(p.input_ids) + max_new_tokens <= shape.kv_max]


def select_prompts(prompts: Sequence[Prompt], shape: BuildShape, max_new_tokens: int,
                   names: list[str] | None) -> tuple[list[int], Coverage]:
    """The prompts a variant validates, and which of them cover its bucket.

    Explicitly named prompts must fit; otherwise every prompt that fits is used, and the set must hold one prompt
    near the bucket size (between half a bucket and a bucket) and one spanning several buckets. Raises
    ``InputError`` before anything is loaded.
    """
    if names:
        by_name = {p.name: i for i, p in enumerate(prompts)}
        chosen = [by_name[n] for n in names]
        for i in chosen:
            length = len(prompts[i].input_ids)
            if length + max_new_tokens > shape.kv_max:
                raise InputError(f"validation prompt {prompts[i].name!r} has {length} tokens; with "
                                 f"{max_new_tokens} new tokens it needs {length + max_new_tokens} cache positions but "
                                 f"variant.kv_max is {shape.kv_max}: drop it from validate.prompt_names or lower "
                                 "validate.max_new_tokens")
    else:
        chosen = applicable(prompts, shape, max_new_tokens)
    if not chosen:
        raise InputError(f"no validation prompt fits variant.kv_max={shape.kv_max} with {max_new_tokens} new tokens: "
                         "add a shorter prompt to validate.prompts")
    lengths = {prompts[i].name: len(prompts[i].input_ids) for i in chosen}
    near = [n for n, length in lengths.items()
            if shape.bucket // 2 < length <= shape.bucket and shape.bucket_for(length) == shape.bucket]
    spans = [n for n, length in lengths.items() if length > 2 * shape.bucket]
    ladder = {str(b): tuple(n for n, length in lengths.items() if last_call(shape, length) == b)
              for b in shape.smaller_buckets}
    coverage = Coverage(near_bucket=tuple(near), multi_bucket=tuple(spans), smaller_buckets=ladder)
    if names or shape.prefill != "device":
        return chosen, coverage
    missing = [what for what, found in (("one between half a bucket and a bucket", near),
                                        ("one longer than two buckets", spans)) if not found]
    if missing:
        raise InputError(f"the validation prompts that fit {shape.kv_max}/{shape.bucket} lack {' and '.join(missing)} "
                         f"(lengths: {lengths}): add prompts to validate.prompts (max_tokens near {shape.bucket} and "
                         f"above {2 * shape.bucket}, below {shape.kv_max - max_new_tokens})")
    unused = [int(b) for b, found in ladder.items() if not found]
    if unused:
        raise InputError(f"no validation prompt that fits {shape.kv_max}/{shape.bucket} ends in the prefill bucket(s) "
                         f"{unused} of variant.smaller_buckets={list(shape.smaller_buckets)} (lengths: {lengths}), so "
                         "their graphs would ship unchecked: drop those buckets, or add a prompt to validate.prompts "
                         "whose last part is just below each")
    return chosen, coverage


def last_call(shape: BuildShape, length: int) -> int:
    """The bucket a prompt of ``length`` tokens ends in (decoding/runner.py: full buckets while more remain)."""
    return shape.bucket_for(length - (length - 1) // shape.bucket * shape.bucket)


def first_divergence(ours: list[int], reference: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(ours, reference)):
        if a != b:
            return i
    return None if len(ours) == len(reference) else min(len(ours), len(reference))


def latency_report(step_s: list[float]) -> dict:
    """neuronx-distributed-inference's report keys over per-step latencies, in milliseconds."""
    ms = [s * 1e3 for s in step_s]
    report = {f"latency_ms_p{q}": round(percentile(ms, q), 3) for q in (50, 90, 95, 99, 100)}
    report["latency_ms_avg"] = round(sum(ms) / len(ms), 3)
    return report


def context_lengths(shape: BuildShape, settings: ThroughputConfig) -> dict[str, int]:
    lengths = {"short": settings.short_tokens, "half": shape.kv_max // 2,
               "near_max": shape.kv_max - settings.decode_tokens - 1}
    return {name: max(1, min(lengths[name], shape.kv_max - settings.decode_tokens - 1)) for name in settings.contexts}


def measure_throughput(gen: Generator, shape: BuildShape, settings: ThroughputConfig,
                       filler: list[int]) -> tuple[ThroughputSummary, dict[str, ContextFigures]]:
    """Time to first token and decode latency at each context length, warm-up runs excluded.

    Each run prefills a prompt of the context's length and decodes ``decode_tokens`` tokens, fed a fixed
    continuation so that every run does the same work (a greedy run could stop early on an EOS). Logs one line per
    context as it is done.

    Two rates, not to be confused:

    - ``tokens_per_s``: decode speed, new tokens per second while generating: 1 / the mean decode step latency.
      Per context; the summary's is the slowest context's (what the throughput floor gates and the regression gate
      compares). Prefill is not in it: that is ``ttft_ms``.
    - ``throughput``: neuronx-distributed-inference's end-to-end figure over every timed run of every context:
      (prompt tokens + generated tokens) / (prefill time + decode time). Prompt tokens count, so it grows with the
      context length and is far above ``tokens_per_s``; comparable only between runs of the same settings.
    """
    contexts, pooled, e2e_tokens, e2e_s = {}, [], 0, 0.0
    steps = settings.decode_tokens + 1
    lengths = context_lengths(shape, settings)
    for n, (name, length) in enumerate(lengths.items(), 1):
        prompt = (filler * (length // len(filler) + 1))[:length]
        feed = (filler * (steps // len(filler) + 1))[:steps]
        for _ in range(settings.warmup_runs):
            gen.generate(prompt, steps, forced=feed)
        ttft, decode = [], []
        for _ in range(settings.runs):
            g = gen.generate(prompt, steps, forced=feed)
            ttft.append(g.ttft_s)
            decode += g.decode_s
            e2e_tokens += length + len(g.tokens)
            e2e_s += g.ttft_s + sum(g.decode_s)
        pooled += decode
        avg = sum(decode) / len(decode)
        contexts[name] = ContextFigures(context_tokens=length, ttft_ms=round(1e3 * statistics.median(ttft), 3),
                                        tokens_per_s=round(1 / avg, 3), ms_per_token=round(1e3 * avg, 3),
                                        **latency_report(decode))
        log.info("validate: throughput %d/%d, %s context (%d tokens): %.1f tokens/s, first token %.1f ms", n,
                 len(lengths), name, length, contexts[name].tokens_per_s, contexts[name].ttft_ms)
    slowest = min(contexts.values(), key=lambda c: c.tokens_per_s)
    first = contexts.get("short") or next(iter(contexts.values()))
    summary = ThroughputSummary(tokens_per_s=slowest.tokens_per_s, ms_per_token=slowest.ms_per_token,
                                ttft_ms=first.ttft_ms, **latency_report(pooled),
                                throughput=round(e2e_tokens / e2e_s, 3), decode_steps=len(pooled))
    return summary, contexts


class Explainer:
    """Turns a divergence into text a person can act on: the tokens around it and the top logits on both sides."""

    def __init__(self, weights: str):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(weights)

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def top(self, logits: torch.Tensor) -> tuple[TopToken, ...]:
        values, ids = logits.float().topk(min(TOP_SHOWN, logits.numel()))
        return tuple(TopToken(token=int(i), text=self.text([int(i)]), logit=round(float(v), 4))
                     for v, i in zip(values, ids))

    def divergence(self, prompt: ReferencePrompt, step: int, ours_tokens: list[int], ours_logits: torch.Tensor,
                   ref_logits: torch.Tensor) -> Divergence:
        ref = list(prompt.output_ids)
        start = max(0, step - CONTEXT)
        both = step < len(ours_logits) and step < len(ref_logits)  # a step past either side's end has no logits
        return Divergence(step=step, context_before=self.text(ref[start:step]),
                          reference_after=self.text(ref[step:step + CONTEXT]),
                          ours_after=self.text(ours_tokens[step:step + CONTEXT]),
                          ours_top=self.top(ours_logits[step]) if both else None,
                          reference_top=self.top(ref_logits[step]) if both else None)


def judge(prompt: ReferencePrompt, gen: Generation, ref_logits: torch.Tensor, mode: str, parity: ParityConfig,
          noise: DtypeNoise | None, explainer: Explainer) -> PromptVerdict:
    """One prompt's parity verdict and report entry."""
    ref_tokens = list(prompt.output_ids)
    if mode == "exact":
        index = first_divergence(gen.tokens, ref_tokens)
        compared = index if index is not None else len(ref_tokens)
        errors = logit_errors(gen.logits[:compared], ref_logits[:compared], ref_tokens[:compared])
        by_mode = {"passed": index is None}
    else:
        errors = logit_errors(gen.logits, ref_logits, ref_tokens)
        index = errors.divergences[0].step if errors.divergences else None
        by_mode = {"teacher_forced_match": round(errors.match_share, 4), "relative_error": errors.relative,
                   "divergences": len(errors.divergences)}
        if mode == "teacher_forced":
            passed = errors.match_share >= parity.teacher_forced_min
            by_mode |= {"passed": passed, "failures": None if passed else (
                f"teacher-forced match {errors.match_share:.3f} < {parity.teacher_forced_min}",)}
        else:
            logits = judge_logits(errors, ref_logits, parity.logits, noise)
            by_mode |= {"passed": logits.passed, "route": logits.route, "failures": tuple(logits.failures)}
    verdict = PromptVerdict(prompt=prompt.name, prompt_tokens=len(prompt.input_ids), mode=mode,
                            new_tokens=len(gen.tokens), reference_tokens=len(ref_tokens), first_divergence=index,
                            max_abs_dlogit=errors.absolute.all, ttft_ms=round(gen.ttft_s * 1e3, 3),
                            prefill_calls=gen.prefill_calls, **by_mode)
    if index is not None and not verdict.passed:
        verdict = replace(verdict, divergence=explainer.divergence(prompt, index, gen.tokens, gen.logits, ref_logits))
    return verdict


def check_prompt(gen: Generator, reference: ReferenceRecord, i: int, tensors: dict, shape: BuildShape, mode: str,
                 parity: ParityConfig, explainer: Explainer,
                 position: tuple[int, int]) -> tuple[PromptVerdict, Generation]:
    """Decode reference prompt ``i`` alone and judge it; logs its verdict (``position``: (n, of)) as soon as it is
    known. Returns the verdict and what was decoded."""
    prompt = reference.prompts[i]
    forced = None if mode == "exact" else list(prompt.output_ids)
    g = gen.generate(list(prompt.input_ids), reference.max_new_tokens, forced=forced)
    noise = prompt.dtype_noise.get(shape.dtype) if shape.dtype == "bf16" else None
    verdict = judge(prompt, g, logits_of(tensors, i), mode, parity, noise, explainer)
    log.info("validate: prompt %d/%d %s (%d tokens): %s (%s), %d new tokens, first token %.1f ms", *position,
             prompt.name, verdict.prompt_tokens, "pass" if verdict.passed else "FAIL", mode, verdict.new_tokens,
             g.ttft_s * 1e3)
    return verdict, g


@dataclass(frozen=True)
class ValidationJob:
    """What the stage gives the fresh process (JOB.json): the build, the float reference, and the settings the
    verdicts and the measurement follow."""

    manifest: Manifest
    archive: str
    reference: ReferenceRecord
    reference_tensors: str
    prompts: list[int]  # indices into reference.prompts
    parity: ParityConfig  # validate.parity
    throughput: ThroughputConfig  # validate.throughput
    weights: str
    text_prefix: str
    head_key: str
    workdir: str  # the unpacked ranks go into a fresh folder beside it
    warmup_prompts: int

    def to_json(self) -> dict:
        return asdict(self) | {"manifest": self.manifest.to_json(), "reference": self.reference.to_json()}

    @classmethod
    def from_json(cls, data: dict) -> ValidationJob:
        """The job the stage wrote, its records read strictly and its settings typed and checked as the stage's
        configuration was."""
        expected = {f.name for f in fields(cls)}
        if set(data) != expected:
            raise InputError(f"the validation job has keys {sorted(set(data) - expected)} it should not, and lacks "
                             f"{sorted(expected - set(data))}: the stage and the worker are of different versions "
                             "of the pipeline (reinstall it)")
        raw = cls(**data)  # its records and settings still as JSON, read into their types here
        return replace(raw, manifest=Manifest.from_json(raw.manifest, "the validation job's manifest"),
                       reference=ReferenceRecord.from_json(raw.reference, "the validation job's reference"),
                       parity=section(ParityConfig, raw.parity, "validate.parity"),
                       throughput=section(ThroughputConfig, raw.throughput, "validate.throughput"))


def judge_parity(gen: Generator, job: ValidationJob, tensors: dict,
                 explainer: Explainer) -> tuple[list[PromptVerdict], BatchParity | None]:
    """Every chosen prompt decoded alone and judged against the reference (after the warm-up prompts); for a batched
    build, then all of them decoded together, each against itself alone (pipeline/validation/batch.py)."""
    reference, shape, chosen = job.reference, job.manifest.shape, job.prompts
    mode, max_new = job.parity.mode(shape.dtype), reference.max_new_tokens
    first = list(reference.prompts[chosen[0]].input_ids)
    for _ in range(job.warmup_prompts):
        gen.generate(first, max_new)  # first-call costs, never timed
    checked = [check_prompt(gen, reference, i, tensors, shape, mode, job.parity, explainer, (n, len(chosen)))
               for n, i in enumerate(chosen, 1)]
    if not shape.batched:
        return [verdict for verdict, _ in checked], None
    prompts = [reference.prompts[i] for i in chosen]
    batch = together(gen.batch, gen.eos_ids, [p.name for p in prompts], [list(p.input_ids) for p in prompts], max_new,
                     [None if mode == "exact" else list(p.output_ids) for p in prompts],
                     [(g.tokens, g.logits) for _, g in checked])
    return [verdict for verdict, _ in checked], batch


def run_job(job: ValidationJob) -> Measured:
    """Verify, unpack and load the build, judge its parity on the chosen prompts, then measure its throughput: the
    metrics RESULT.json holds."""
    from pipeline.recipe.checkpoint import Checkpoint
    from pipeline.recipe.host import HostEmbeddings, HostPrefill
    from pipeline.recipe.spec import load_spec

    manifest = job.manifest
    shape = manifest.shape
    reference = job.reference
    mode = job.parity.mode(shape.dtype)
    tensors = reference_tensors(job)  # refused before anything is unpacked or loaded
    explainer = Explainer(job.weights)

    work = temp_dir_beside(Path(job.workdir))
    started = time.monotonic()
    try:
        with reporting_full_disk(work, "validate: unpacking the archive"):
            ranks = extract_verified(Path(job.archive), manifest, work / "ranks")
        unpacked = time.monotonic()
        spec = load_spec(job.weights)
        with Checkpoint(job.weights, job.text_prefix, job.head_key) as ckpt:
            host = HostPrefill(ckpt, spec, shape.kv_max, shape.torch_dtype) if shape.prefill == "host" else None
            with get_backend(manifest.backend).load(ranks, shape) as runner:
                loaded = time.monotonic()
                log.info("validate: archive verified and unpacked in %.1f s, ranks loaded in %.1f s",
                         unpacked - started, loaded - unpacked)
                gc.freeze()  # tokenizer, host model and reference stay for the whole job: keep them out of GC passes
                gen = Generator(runner, HostEmbeddings(ckpt, spec), spec.eos_token_ids, spec.pad_token_id, host,
                                decode_threads=job.throughput.decode_threads)
                report, batch_parity = judge_parity(gen, job, tensors, explainer)
                parity_done = time.monotonic()
                filler = [t for p in reference.prompts for t in p.input_ids]
                summary, contexts = measure_throughput(gen, shape, job.throughput, filler)
                concurrency = measure_concurrency(gen.batch, shape, job.throughput, filler)
                threads = gen.threads
                matmuls = bf16_matmuls(runner, gen.batch) if shape.dtype == "bf16" else None
                collectives = getattr(runner, "collectives", None)
                rss = runner.peak_rss_bytes() if hasattr(runner, "peak_rss_bytes") else []
    finally:
        shutil.rmtree(work, ignore_errors=True)

    return Measured(
        parity=parity_summary(mode, report, batch_parity),
        throughput=summary,
        contexts=contexts,
        costs_s=Costs(verify_unpack=round(unpacked - started, 3), load=round(loaded - unpacked, 3),
                      parity=round(parity_done - loaded, 3), throughput=round(time.monotonic() - parity_done, 3)),
        peak_rss_mb=PeakRss(ranks=round(max(rss) / 2**20, 1) if rss else None, host=round(peak_rss_bytes() / 2**20, 1)),
        threads=threads,
        prompts=tuple(report),
        concurrency=concurrency,
        batch_parity=batch_parity,
        bf16_matmul=matmuls,
        rank_collectives=collectives,
    )


def bf16_matmuls(runner, batch) -> Bf16Matmuls:
    """What validation.json records of the bf16 matmul route (pipeline/host/bf16_matmul.py)."""
    return Bf16Matmuls(ranks=getattr(runner, "bf16_matmul", None), host_prefill=batch.host_bf16_matmul,
                       cpu_bf16_flags=bf16_matmul.cpu_bf16_flags(), min_rows=bf16_matmul.MIN_ROWS,
                       overridden=bf16_matmul.overridden())


def reference_tensors(job: ValidationJob) -> dict[str, torch.Tensor]:
    """The reference's logits, refused if they are not the ones reference.json was written with."""
    from safetensors.torch import load_file

    if sha256_file(job.reference_tensors) != job.reference.logits_file.sha256:
        raise StaleInputError(f"{job.reference_tensors} does not match reference.json: "
                              "run stage=reference force=true")
    return load_file(job.reference_tensors)


def parity_summary(mode: str, report: list[PromptVerdict], batch: BatchParity | None = None) -> ParitySummary:
    """The prompts' verdicts in one: passed only if every prompt passed (and, for a batched build, they decoded
    together as alone), and the worst figures."""
    shares = [r.teacher_forced_match for r in report if r.teacher_forced_match is not None]
    passed = all(r.passed for r in report) and (batch is None or batch.passed)
    return ParitySummary(mode=mode, passed=passed, prompts=len(report),
                         prompts_matched=sum(r.passed for r in report),
                         teacher_forced_match=round(min(shares), 4) if shares else None,
                         max_abs_dlogit=round(max(r.max_abs_dlogit for r in report), 6))


def main(argv: list[str]) -> int:
    setup()  # records go to the stage as JSON lines, which it logs as its own (pipeline/core/log.py, relay)
    # The stage that started this process holds its NeuronCores' lease: never outlive it (a killed stage's lease is
    # released by the kernel, and another run may then be given the cores this process still uses).
    die_with_parent()
    job_path, result_path = Path(argv[0]), Path(argv[1])
    job = json.loads(job_path.read_text())
    # One thread for everything but host prefill, which the Generator runs on every usable CPU (its thread policy,
    # recorded in validation.json): the decode loop and the comparisons are measured as a server runs them.
    torch.set_num_threads(1)
    try:
        result = WorkerResult(metrics=run_job(ValidationJob.from_json(job)))
    except KeyboardInterrupt:  # the stage process was interrupted too, and says so
        return 130
    except PipelineError as exc:  # the stage raises it again, as the same class (its message says what to fix)
        result = WorkerResult(failure=ErrorRecord.of(exc))
    except Exception as exc:  # noqa: BLE001 - a bug: its traceback goes to the stage's log, the stage reports it
        log.exception("validation failed")
        result = WorkerResult(failure=ErrorRecord.of(exc))
    result.write(result_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
