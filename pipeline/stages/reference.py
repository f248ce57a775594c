"""Stage 3, reference: greedy-decode the validation prompts with the independent float reference.

The reference is Hugging Face ``transformers`` on the CPU in fp32 with eager attention: none of the recipe's code.
It is independent of the compiler, so compiler upgrades reuse it.

Writes ``artifacts/<model>/reference.json`` (``ReferenceRecord``, pipeline/validation/reference_records.py: the
prompts, their token ids, the reference's generated ids, versions, fingerprint) and ``reference.safetensors`` (per
prompt: the top-``k`` logits in fp32 with their token ids, and every logit in fp16), so validation never reruns the
float model.
"""

from __future__ import annotations

import time

import torch

from pipeline import __version__
from pipeline.config import PipelineConfig
from pipeline.core.build_records import ModelRecord
from pipeline.core.errors import PipelineError, StaleInputError
from pipeline.core.fsutil import atomic_write_bytes, sha256_file
from pipeline.core.log import log, progress
from pipeline.core.records import fingerprint
from pipeline.host import bf16_matmul, preflight
from pipeline.host.procinfo import peak_rss_bytes
from pipeline.paths import Paths
from pipeline.stages import StageResult, StageStatus, code_of
from pipeline.stages import model as model_stage
from pipeline.stages.toolchain import package_version
from pipeline.validation.parity import logits_of
from pipeline.validation.prompts import build_prompts
from pipeline.validation.reference_records import (
    DtypeNoise,
    LogitsFile,
    Prompt,
    ReferenceModel,
    ReferencePeak,
    ReferencePreflight,
    ReferencePrompt,
    ReferenceRecord,
    ReferenceVersions,
)

TOP_K = 1000


def load_tokenizer(weights):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(weights)


def stored_dtype(weights) -> torch.dtype:
    """The dtype every floating tensor of the checkpoint is stored in (fp32 when they differ)."""
    from safetensors import safe_open

    found = set()
    for path in sorted(weights.glob("*.safetensors")):
        with safe_open(path, framework="pt") as f:
            found |= {f.get_slice(key).get_dtype() for key in f.keys()}
    floating = found & {"BF16", "F16", "F32", "F64"}
    return {"BF16": torch.bfloat16, "F16": torch.float16}.get(floating.pop(), torch.float32) \
        if len(floating) == 1 else torch.float32


def load_float_model(weights):
    """transformers' own Gemma-4 computing in fp32 with eager attention: the text model, or the multimodal one.

    The same numbers as ``from_pretrained(dtype=float32)``, in less memory: the model is loaded at the checkpoint's
    stored dtype (transformers maps the files, nothing is read yet), then every tensor of the text decoder becomes
    fp32 (an exact conversion from bf16) except the per-layer embedding table, which stays mapped in its file and
    whose lookups are converted instead (the same values). E4B in fp32 is about 30 GB, 11.3 GB of it that table (and
    the vision and audio towers, which a text prompt never runs): this way it holds 18.9 GB, and fits a 24 GiB host.
    """
    import json
    import types

    from transformers import Gemma4ForCausalLM, Gemma4ForConditionalGeneration

    config = json.loads((weights / "config.json").read_text())
    cls = Gemma4ForConditionalGeneration if config.get("model_type") == "gemma4" else Gemma4ForCausalLM
    model = cls.from_pretrained(weights, dtype=stored_dtype(weights), attn_implementation="eager").eval()
    text = getattr(model.model, "language_model", model.model)
    table = getattr(text, "embed_tokens_per_layer", None)
    for module in [*text.modules(), model.lm_head]:
        if module is table:
            continue
        for param in module.parameters(recurse=False):
            if param.is_floating_point() and param.dtype != torch.float32:
                param.data = param.data.float()  # a tied head shares the token table's parameter: once for both
        for name, buf in module.named_buffers(recurse=False):
            if buf.is_floating_point() and buf.dtype != torch.float32:
                module._buffers[name] = buf.float()
        if hasattr(module, "scalar_embed_scale"):
            # Computed at construction, at the loading dtype: bf16 rounds sqrt(2560) to 50.5. As an fp32 model has it.
            module.embed_scale = torch.tensor(float(module.scalar_embed_scale))
    if table is not None and table.weight.dtype != torch.float32:
        table.embed_scale = torch.tensor(float(table.scalar_embed_scale))

        def lookup(self, input_ids):  # fp32 rows of the mapped table, scaled in fp32: as the fp32 model computes
            return torch.nn.functional.embedding(input_ids, self.weight, self.padding_idx).float() * self.embed_scale

        table.forward = types.MethodType(lookup, table)
    return model


def as_bf16(model):
    """transformers' own bf16 model of the same weights: ``load_float_model``'s lookup undone, every tensor cast."""
    text = getattr(model.model, "language_model", model.model)
    table = getattr(text, "embed_tokens_per_layer", None)
    if table is not None:
        table.__dict__.pop("forward", None)  # the class's own forward again
    return model.to(torch.bfloat16)


def expected_fingerprint(cfg: PipelineConfig, model_record: ModelRecord, prompts: list[Prompt]) -> str:
    return fingerprint({
        "weights": model_record.weights_digest,
        "prompts": [list(p.input_ids) for p in prompts],
        "max_new_tokens": cfg.validate.max_new_tokens,
        "top_k": TOP_K,
        "torch": package_version("torch"),
        "transformers": package_version("transformers"),
        "code": code_of("reference"),
    })


def dtype_noise(model, prompt_ids: list[int], continuation: list[int], reference: torch.Tensor) -> DtypeNoise:
    """transformers' bf16 model, teacher-forced on the fp32 continuation: its logit errors against fp32.

    Its bf16 matmuls run in fp32 over the same bf16 values, rounded back to bf16 (pipeline/host/bf16_matmul.py), on
    every CPU, so the figure is the same on every x86 CPU and costs about what the fp32 pass does. With torch's
    default kernels it depended on the CPU: with bf16 instructions (avx512_bf16, AMX) torch sends bf16 matmuls to
    oneDNN, whose rounding differs from torch's own kernels, the ones an AVX2-only CPU runs. Seen on the tiny model's
    spans_64 prompt: transformers' top-5 error 0.0301 through oneDNN, 0.0428 through torch's kernels, while a bf16
    build's moved the other way (0.034 -> 0.050), so the same build passed on one CPU and failed on the other. The
    reference is made once and judges builds on other machines (a DVC remote): it must not hold one CPU's rounding.
    torch's own kernels everywhere (oneDNN off) made it the same too, but 5-8x slower than the fp32 pass at full
    size (899-1125 s against 190 s here; 1539 s on an AVX2-only EPYC, issue 50)."""
    from pipeline.validation.parity import logit_errors

    with torch.no_grad(), bf16_matmul.Fp32Matmuls(min_rows=1):
        out = model(input_ids=torch.tensor([prompt_ids + continuation[:-1]])).logits
    ours = out[0, len(prompt_ids) - 1:].float()
    errors = logit_errors(ours, reference, continuation)
    return DtypeNoise(relative=errors.relative, absolute=errors.absolute, divergences=len(errors.divergences),
                      steps=errors.steps)


def generate(model, prompt_ids: list[int], max_new_tokens: int, eos_ids, pad_id) -> tuple[list[int], torch.Tensor]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, eos_token_id=list(eos_ids),
                             pad_token_id=pad_id)
    return out.sequences[0, len(prompt_ids):].tolist(), torch.stack(out.logits)[:, 0].float()


def run(cfg: PipelineConfig) -> StageResult:
    from safetensors.torch import save

    from pipeline.recipe.spec import load_spec

    paths = Paths.of(cfg)
    model_record = model_stage.load(cfg)
    tokenizer = load_tokenizer(paths.weights)
    prompts = build_prompts(tokenizer, cfg.validate.prompts)
    fp = expected_fingerprint(cfg, model_record, prompts)
    previous = ReferenceRecord.read_if_valid(paths.reference)
    if not cfg.force and previous and previous.fingerprint == fp and paths.reference_tensors.exists():
        log.info("reference: up to date (%s)", paths.reference)
        return StageResult("reference", StageStatus.skipped)
    started = time.monotonic()
    spec = load_spec(paths.weights)
    need = preflight.reference_need(spec)
    host = preflight.check(need, cfg.preflight)  # before a byte of the model is read
    log.info("reference: preflight passed (%s)", host.summary())
    model = load_float_model(paths.weights)
    tensors, continuations = {}, []
    for i, prompt in enumerate(progress(prompts, desc="reference")):
        ids, logits = generate(model, list(prompt.input_ids), cfg.validate.max_new_tokens, spec.eos_token_ids,
                               spec.pad_token_id)
        k = min(TOP_K, logits.shape[-1])
        top = logits.topk(k, dim=-1)
        tensors[f"{i}.topk_values"] = top.values.contiguous()
        tensors[f"{i}.topk_indices"] = top.indices.to(torch.int32).contiguous()
        tensors[f"{i}.logits"] = logits.to(torch.float16).contiguous()
        continuations.append(ids)
        log.info("reference: %-10s %4d prompt tokens -> %d new tokens", prompt.name, len(prompt.input_ids), len(ids))
    model = as_bf16(model)  # the same weights rounded: the dtype noise bf16 builds are judged against
    entries = tuple(
        ReferencePrompt.of(prompt, ids, stopped_on_eos=bool(ids and ids[-1] in spec.eos_token_ids),
                           dtype_noise={"bf16": dtype_noise(model, list(prompt.input_ids), ids, logits_of(tensors, i))})
        for i, (prompt, ids) in enumerate(zip(prompts, continuations)))
    atomic_write_bytes(paths.reference_tensors, save(tensors, metadata={"format": "pt"}))
    ReferenceRecord(
        fingerprint=fp,
        model=ReferenceModel(name=cfg.model.name, weights_digest=model_record.weights_digest),
        max_new_tokens=cfg.validate.max_new_tokens,
        top_k=TOP_K,
        prompts=entries,
        logits_file=LogitsFile(name=paths.reference_tensors.name, sha256=sha256_file(paths.reference_tensors)),
        versions=ReferenceVersions(torch=package_version("torch"), transformers=package_version("transformers"),
                                   pipeline=__version__),
        eos_token_ids=tuple(spec.eos_token_ids),
        # what the estimate can be derived from again: the need beside this process's measured peak
        preflight=ReferencePreflight(need=need.figures(), host=host.figures(),
                                     measured=ReferencePeak(peak_rss_bytes=peak_rss_bytes())),
    ).write(paths.reference)
    return StageResult("reference", StageStatus.ran, time.monotonic() - started)


def load(cfg: PipelineConfig) -> tuple[ReferenceRecord, dict[str, torch.Tensor]]:
    """The reference record (read strictly) and tensors; refuses a missing one, or one stale for the model or the
    prompts."""
    from safetensors.torch import load_file

    paths = Paths.of(cfg)
    missing = [str(p) for p in (paths.reference, paths.reference_tensors) if not p.exists()]
    if missing:
        raise PipelineError(f"{', '.join(missing)} missing or unreadable: run stage=reference first")
    record = ReferenceRecord.read(paths.reference)
    model_record = model_stage.load(cfg)
    prompts = build_prompts(load_tokenizer(paths.weights), cfg.validate.prompts)
    if record.model.weights_digest != model_record.weights_digest:
        raise StaleInputError(f"{paths.reference} is stale: it was made for other weights than {paths.weights}; "
                               "run stage=reference")
    if [p.input_ids for p in record.prompts] != [p.input_ids for p in prompts] \
            or record.max_new_tokens != cfg.validate.max_new_tokens:
        raise StaleInputError(f"{paths.reference} is stale: validate.prompts or validate.max_new_tokens changed "
                               "since it was made; run stage=reference")
    if sha256_file(paths.reference_tensors) != record.logits_file.sha256:
        raise StaleInputError(f"{paths.reference_tensors} does not match {paths.reference}: "
                               "run stage=reference force=true")
    return record, load_file(paths.reference_tensors)
