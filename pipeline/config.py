"""The typed configuration schema, and the validation of a composed Hydra config against it.

``structured`` merges a composed config (``conf/`` plus overrides) into the ``PipelineConfig`` dataclasses, turning
OmegaConf's type errors into messages naming the key and its allowed values; ``problems`` checks every cross-field
rule. ``pipeline.run.load_config`` joins them (and the stage names, which the stage registry holds) into one
``ConfigError`` listing every problem, before any stage does any work.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, MissingMandatoryValue, OmegaConfBaseException

from pipeline.core.errors import ConfigError
from pipeline.core.shape import DTYPES, PREFILL_MODES, BuildShape
from pipeline.core.units import parse_size, visible_cores_problems
from pipeline.models.tiny_model import TinyModelConfig

BACKENDS = ("auto", "cpu", "neuron")
MODEL_SOURCES = ("tiny", "hub")
PUBLISH_TARGETS = ("local", "hub")
ARCHIVE_FORMATS = ("tar.zst", "tar.gz", "tar")
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
REPO_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")
REVISION_RE = re.compile(r"^[0-9a-f]{40}$")
PLACEHOLDER_OWNERS = ("your-org", "your-username", "your-name", "org", "user", "username", "example")


@dataclass
class ResourceNeed:
    """What building and loading one variant of a model needs on one backend, in GiB (estimates; build.json
    records each trace's measured peaks, so they can be tuned)."""

    trace_base_gb: float = 0.0
    """The tracing process itself: reading the weights and building the graphs."""
    trace_per_graph_gb: float = 0.0
    """Each graph compiled at the same time (a rank for host prefill; prefill and decode for device prefill)."""
    validate_gb: float = 0.0
    """Loading a build and decoding with it."""
    host_prefill_gb: float = 0.0
    """The host's float model that prefills host-prefill variants (validate only)."""
    disk_gb: float = 0.0
    """Written per variant: compiler work files, the rank files and the archive."""


@dataclass
class ModelConfig:
    name: str = MISSING
    """Directory name under ``artifacts_dir``; one per model."""
    source: str = "hub"
    """``hub`` (a pinned snapshot of ``hub_id``) or ``tiny`` (generated locally from ``tiny``)."""
    hub_id: str | None = None
    revision: str | None = None
    """The Hub commit (40 hex digits) the snapshot is pinned to."""
    path: str | None = None
    """A local checkpoint directory to build from instead of the source."""
    text_prefix: str = "model."
    """Where the decoder's tensors live in the checkpoint (``model.language_model.`` in the multimodal release)."""
    head_key: str = "lm_head.weight"
    allow_patterns: list[str] = field(default_factory=lambda: ["*.json", "*.safetensors", "tokenizer*", "*.jinja"])
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    resources: dict[str, ResourceNeed] = field(default_factory=dict)
    """``resources.<backend>``: what the preflight checks the host against before trace and validate."""

    def __post_init__(self) -> None:
        # OmegaConf checks the nested keys but hands back plain dicts inside a dict-typed field.
        self.resources = {k: v if isinstance(v, ResourceNeed) else ResourceNeed(**v) for k, v in self.resources.items()}


@dataclass
class VariantConfig:
    name: str = MISSING
    kv_max: int = MISSING
    """KV cache length: prompt plus generated tokens must fit."""
    bucket: int = MISSING
    """Prefill bucket: device prefill runs the prompt in chunks of this many tokens."""
    dtype: str = MISSING
    """``bf16`` or ``fp32``: weights, matmuls and KV caches (the residual stream is fp32 either way)."""
    prefill: str = MISSING
    """``device`` (prefill and decode graphs over one weight set) or ``host`` (host prefill seeds the KV)."""
    tp_degree: int = 2

    @property
    def shape(self) -> BuildShape:
        return BuildShape(self.kv_max, self.bucket, self.dtype, self.prefill, self.tp_degree)


@dataclass
class BackendConfig:
    name: str = "auto"
    """``cpu``, ``neuron``, or ``auto`` (neuron when NeuronCores and the Neuron packages are present)."""
    compiler_args: dict[str, list[str]] = field(default_factory=dict)
    """neuronx-cc arguments per variant dtype (recorded in the manifest)."""
    compiler_workdir: str | None = None
    compile_cache_dir: str | None = None
    max_parallel: int = 0
    """Ranks compiled at once (0: all)."""
    check_sdk_release: bool = True
    """Refuse installed Neuron packages that are not exactly one SDK release (pipeline/backends/neuron_sdk.py)."""
    allow_unsupported_host_prefill: bool = False
    """Compile host-prefill variants on an SDK release where parallel_model_trace is not known to work."""
    visible_cores: str | None = None
    """NeuronCores a neuron trace or validation uses, like ``0-1`` (NEURON_RT_VISIBLE_CORES); null: the first
    ``tp_degree`` free ones (pipeline/backends/neuron_cores.py)."""


@dataclass
class PreflightConfig:
    check: bool = True
    """Refuse to trace or validate on a host short of memory, disk or NeuronCores (pipeline/host/preflight.py)."""
    make_swap: str | None = None
    """Create and enable a swap file of this size (e.g. ``64G``) when memory is short. Needs root."""
    swap_file: str = "/swapfile"


@dataclass
class HardwareConfig:
    name: str = "local"
    neuron_cores: int = 0
    host_ram_gb: float | None = None
    vcpus: int | None = None
    disk_gb: float | None = None


@dataclass
class PromptConfig:
    name: str = MISSING
    max_tokens: int = MISSING
    """The templated prompt is filled with the shipped passages up to this many tokens."""
    question: str = "Summarise the text above in one paragraph."


PARITY_MODES = ("exact", "teacher_forced", "logits")


@dataclass
class LogitsConfig:
    """neuronx-distributed-inference's logit matching (pipeline/validation/parity.py)."""

    divergence_tol: float = 0.001
    tol_map: dict[str, list[float]] = field(default_factory=lambda: {
        "top5": [1e-5, 0.01], "top50": [1e-5, 0.02], "top1000": [1e-5, 0.03], "all": [1e-5, 0.05]})
    """Per top-k slice of the reference's logits: [atol, rtol]."""
    dtype_noise: bool = True
    """bf16 only: also pass a prompt whose errors are within noise_multiplier x transformers' own bf16 errors."""
    noise_multiplier: float = 1.5


@dataclass
class ParityConfig:
    fp32: str = "exact"
    bf16: str = "logits"
    teacher_forced_min: float = 0.95
    logits: LogitsConfig = field(default_factory=LogitsConfig)

    def mode(self, dtype: str) -> str:
        return getattr(self, dtype)


CONTEXTS = ("short", "half", "near_max")


@dataclass
class FloorConfig:
    """A throughput gate. Unset (null) limits are not gated."""

    tokens_per_s: float | None = None
    """Decode tokens per second, the slowest context must reach it."""
    ttft_ms_device: float | None = None
    """Time to first token at the short context, device-prefill variants."""
    ttft_ms_host: float | None = None
    """Time to first token at the short context, host-prefill variants."""


@dataclass
class ThroughputConfig:
    contexts: list[str] = field(default_factory=lambda: list(CONTEXTS))
    """Prompt lengths measured: short_tokens, half of kv_max, and kv_max minus the decoded tokens."""
    short_tokens: int = 16
    decode_tokens: int = 16
    runs: int = 2
    warmup_runs: int = 1
    floors: dict[str, dict[str, FloorConfig]] = field(default_factory=dict)
    """``floors.<backend>.<hardware>``; the hardware name ``any`` matches every hardware of that backend."""

    def __post_init__(self) -> None:
        # OmegaConf checks the nested FloorConfig keys but hands back plain dicts two levels down.
        self.floors = {backend: {hw: f if isinstance(f, FloorConfig) else FloorConfig(**f) for hw, f in inner.items()}
                       for backend, inner in self.floors.items()}

    def floor(self, backend: str, hardware: str) -> tuple[str | None, FloorConfig | None]:
        by_hardware = self.floors.get(backend, {})
        for name in (hardware, "any"):
            if name in by_hardware:
                return f"{backend}.{name}", by_hardware[name]
        return None, None


@dataclass
class ValidateConfig:
    max_new_tokens: int = 32
    prompts: list[PromptConfig] = field(default_factory=list)
    warmup_prompts: int = 1
    """Generations run before timing starts (excluded from throughput)."""
    parity: ParityConfig = field(default_factory=ParityConfig)
    throughput: ThroughputConfig = field(default_factory=ThroughputConfig)
    prompt_names: list[str] | None = None
    """The prompts a variant must validate; null: every prompt that fits its kv_max."""


@dataclass
class SigningConfig:
    private_key: str | None = None
    """PEM elliptic-curve key: the manifest is signed at package time (and the published one at publish)."""
    public_key: str | None = None
    """PEM public key checked at validate (derived from private_key when unset)."""
    allow_unsigned: bool = False
    """Accept artifacts no key can verify. Only for local experiments: a release sets the keys."""

    def verifying_key(self) -> str | bytes | None:
        if self.public_key:
            return self.public_key
        if self.private_key:
            from pipeline.artifact.signing import public_key_pem

            return public_key_pem(self.private_key)
        return None


@dataclass
class PackageConfig:
    format: str = "tar.zst"
    threads: int = 0
    """zstd worker threads (0: one per core). The archive's bytes do not depend on it."""
    signing: SigningConfig = field(default_factory=SigningConfig)


@dataclass
class RegressionConfig:
    """How much worse than the last published version of a variant a rebuild may be
    (pipeline/publishing/regression.py)."""

    tokens_per_s_drop: float = 0.10
    """Largest accepted fall of decode tokens/s (slowest context), as a fraction of the previous figure."""
    ttft_ms_rise: float = 0.20
    """Largest accepted rise of time to first token, as a fraction of the previous figure."""
    teacher_forced_drop: float = 0.02
    """Largest accepted fall of the teacher-forced match (a share of positions)."""
    throughput_backends: list[str] = field(default_factory=lambda: ["neuron"])
    """Backends whose throughput is compared. The cpu backend's timings are reference figures that swing with the
    machine's load by tens of percent between runs, so by default only its parity is compared."""


@dataclass
class PublishConfig:
    target: str = "local"
    repo_id: str = "gemma-4-E4B-it-inferentia2"
    local_dir: str = "published"
    """For ``target=local``: the folder laid out as the Hub repo would be (relative to ``artifacts_dir``)."""
    private: bool = True
    retries: int = 5
    """Attempts of the publish step on conflicts (409/412) and transient failures (5xx, connection errors)."""
    retry_base_s: float = 1.0
    retry_max_s: float = 30.0
    regression: RegressionConfig = field(default_factory=RegressionConfig)
    allow_regression: bool = False
    """Publish a rebuild even if it regressed against the last published version (recorded in its manifest)."""
    allow_demo: bool = False
    """Publish to the Hub a build that is not a real model compiled for Inferentia (the embedded tiny model, or a cpu
    backend build); its model card then says what it is. Local publishing takes them always."""


@dataclass
class PipelineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    variant: VariantConfig | None = None
    backend: BackendConfig = field(default_factory=BackendConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    validate: ValidateConfig = field(default_factory=ValidateConfig)
    package: PackageConfig = field(default_factory=PackageConfig)
    publish: PublishConfig = field(default_factory=PublishConfig)
    preflight: PreflightConfig = field(default_factory=PreflightConfig)
    stage: str = "all"
    force: bool = False
    artifacts_dir: str = "artifacts"

    # -- paths ------------------------------------------------------------------------------------------------

    @property
    def root(self) -> Path:
        return Path(self.artifacts_dir)

    @property
    def model_dir(self) -> Path:
        return self.root / self.model.name

    @property
    def variant_dir(self) -> Path:
        if self.variant is None:
            raise ConfigError("this stage needs a variant: add +variant=NAME")
        return self.model_dir / self.variant.name


def _type_error_message(exc: OmegaConfBaseException) -> str:
    key = getattr(exc, "full_key", None) or "?"
    text = str(exc).splitlines()[0]
    if isinstance(exc, ConfigKeyError):
        return f"unknown key {key!r} (misspelt? see conf/ for the keys each group has)"
    if isinstance(exc, MissingMandatoryValue):
        return f"{key} is required but not set"
    return f"{key}: {text}"


MAX_TYPE_ERRORS = 50  # reported at once; a config with more is hopeless anyway


def structured(cfg: DictConfig | dict) -> PipelineConfig:
    """Merge into the schema and convert to dataclasses.

    Every type error and unknown key becomes one line of a ``ConfigError``, together with the semantic problems of
    the rest of the config (each bad key is dropped in turn, its default standing in), so one run names them all.
    """
    data = OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else copy.deepcopy(cfg)
    found: list[str] = []
    typed = None
    for _ in range(MAX_TYPE_ERRORS):
        try:
            typed = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(PipelineConfig), data))
            break
        except OmegaConfBaseException as exc:
            found.append(_type_error_message(exc))
            if not _drop_key(data, getattr(exc, "full_key", None)):
                break
    if found:
        raise ConfigError(found + (problems(typed) if typed is not None else []))
    return typed


def _drop_key(data: dict, full_key: str | None) -> bool:
    """Remove dotted ``full_key`` from ``data``; False when it cannot be found (a list element, say)."""
    if not full_key or "[" in full_key:
        return False
    *parents, last = full_key.split(".")
    node = data
    for part in parents:
        node = node.get(part) if isinstance(node, dict) else None
    if not isinstance(node, dict) or last not in node:
        return False
    del node[last]
    return True


def _choice(key: str, value: Any, allowed: tuple) -> list[str]:
    return [] if value in allowed else [f"{key}={value!r} is not one of {list(allowed)}"]


def problems(cfg: PipelineConfig) -> list[str]:
    """Every semantic problem of a typed config, each naming the key and the fix."""
    found: list[str] = []
    m = cfg.model
    found += _choice("model.source", m.source, MODEL_SOURCES)
    if not NAME_RE.match(m.name or ""):
        found.append(f"model.name={m.name!r} must be a plain name (letters, digits, '_', '-', '.')")
    if m.path is None and m.source == "hub":
        if not m.hub_id or not REPO_ID_RE.match(m.hub_id):
            found.append(f"model.hub_id={m.hub_id!r} must be a Hub repo id like 'google/gemma-4-E4B-it'")
        if not m.revision or not REVISION_RE.match(m.revision):
            found.append(f"model.revision={m.revision!r} must pin a commit (40 hex digits) so builds are reproducible")
    if m.path is not None and not Path(m.path).is_dir():
        found.append(f"model.path={m.path!r} is not a directory: point it at a checkpoint folder with config.json")
    if not m.text_prefix.endswith("."):
        found.append(f"model.text_prefix={m.text_prefix!r} must end with '.' "
                     "(e.g. 'model.' or 'model.language_model.')")

    if cfg.variant is not None:
        v = cfg.variant
        if not NAME_RE.match(v.name or ""):
            found.append(f"variant.name={v.name!r} must be a plain name")
        found += _choice("variant.dtype", v.dtype, tuple(DTYPES))
        found += _choice("variant.prefill", v.prefill, PREFILL_MODES)
        found += [p for p in v.shape.problems() if not p.startswith(("variant.dtype", "variant.prefill"))]

    for backend, need in m.resources.items():
        found += _choice("model.resources key", backend, ("cpu", "neuron"))
        for key, value in vars(need).items():
            if value < 0:
                found.append(f"model.resources.{backend}.{key}={value} must not be negative")

    found += _choice("backend.name", cfg.backend.name, BACKENDS)
    if cfg.backend.visible_cores is not None and cfg.variant is not None:
        found += visible_cores_problems(cfg.backend.visible_cores, cfg.variant.tp_degree, None)
    if cfg.backend.max_parallel < 0:
        found.append(f"backend.max_parallel={cfg.backend.max_parallel} must be 0 (all ranks) or positive")
    for dtype in cfg.backend.compiler_args:
        found += _choice(f"backend.compiler_args key {dtype!r} (a variant dtype)", dtype, tuple(DTYPES))

    val = cfg.validate
    if val.max_new_tokens < 1:
        found.append(f"validate.max_new_tokens={val.max_new_tokens} must be at least 1")
    if not val.prompts:
        found.append("validate.prompts is empty: validation needs at least one prompt")
    names = [p.name for p in val.prompts]
    if len(set(names)) != len(names):
        found.append(f"validate.prompts names must be unique, got {names}")
    for i, p in enumerate(val.prompts):
        if p.max_tokens < 8:
            found.append(f"validate.prompts[{i}].max_tokens={p.max_tokens} must be at least 8")
    if val.warmup_prompts < 0:
        found.append(f"validate.warmup_prompts={val.warmup_prompts} must be 0 or more")
    par = val.parity
    for dtype in DTYPES:
        found += _choice(f"validate.parity.{dtype}", getattr(par, dtype), PARITY_MODES)
    if not 0.0 <= par.teacher_forced_min <= 1.0:
        found.append(f"validate.parity.teacher_forced_min={par.teacher_forced_min} must be within [0, 1]")
    lg = par.logits
    if lg.divergence_tol < 0:
        found.append(f"validate.parity.logits.divergence_tol={lg.divergence_tol} must not be negative")
    if lg.noise_multiplier <= 0:
        found.append(f"validate.parity.logits.noise_multiplier={lg.noise_multiplier} must be positive")
    tp = val.throughput
    for c in tp.contexts:
        found += _choice("validate.throughput.contexts entry", c, CONTEXTS)
    for key, value in (("short_tokens", tp.short_tokens), ("decode_tokens", tp.decode_tokens), ("runs", tp.runs)):
        if value < 1:
            found.append(f"validate.throughput.{key}={value} must be at least 1")
    if tp.warmup_runs < 0:
        found.append(f"validate.throughput.warmup_runs={tp.warmup_runs} must be 0 or more")
    for backend, by_hardware in tp.floors.items():
        found += _choice("validate.throughput.floors key", backend, ("cpu", "neuron"))
        for hardware, floor in by_hardware.items():
            for name in ("tokens_per_s", "ttft_ms_device", "ttft_ms_host"):
                value = getattr(floor, name)
                if value is not None and value <= 0:
                    found.append(f"validate.throughput.floors.{backend}.{hardware}.{name}={value} "
                                 "must be positive (or null)")
    if val.prompt_names is not None:
        unknown = sorted(set(val.prompt_names) - {p.name for p in val.prompts})
        if unknown:
            known = [p.name for p in val.prompts]
            found.append(f"validate.prompt_names {unknown} are not in validate.prompts ({known})")
    slices = ("top5", "top50", "top1000", "all")
    if sorted(lg.tol_map) != sorted(slices):
        found.append(f"validate.parity.logits.tol_map has keys {sorted(lg.tol_map)}, expected exactly {list(slices)}")
    for key, pair in lg.tol_map.items():
        if len(pair) != 2 or any(v < 0 for v in pair):
            found.append(f"validate.parity.logits.tol_map.{key}={list(pair)} must be [atol, rtol], both >= 0")

    found += _choice("package.format", cfg.package.format, ARCHIVE_FORMATS)
    if cfg.package.threads < 0:
        found.append(f"package.threads={cfg.package.threads} must be 0 (one per core) or positive")
    found += signing_problems(cfg)
    found += _choice("publish.target", cfg.publish.target, PUBLISH_TARGETS)
    if cfg.publish.target == "hub" and (cfg.publish.repo_id or "").split("/")[0] in PLACEHOLDER_OWNERS:
        found.append(f"publish.repo_id={cfg.publish.repo_id!r} is the documentation's placeholder: set it to the "
                     "repository to publish to, publish.repo_id=<your org>/<repo>")
    elif cfg.publish.target == "hub" and "/" not in (cfg.publish.repo_id or ""):
        found.append(f"publish.repo_id={cfg.publish.repo_id!r} names no owner: publish=hub needs 'owner/name'")
    if not REPO_ID_RE.match(cfg.publish.repo_id or "") or len(cfg.publish.repo_id) > 96:
        found.append(f"publish.repo_id={cfg.publish.repo_id!r} must look like 'name' or 'owner/name' (letters, "
                     "digits, '-', '_', '.')")
    if cfg.publish.retries < 1 or cfg.publish.retry_base_s < 0 or cfg.publish.retry_max_s < cfg.publish.retry_base_s:
        found.append(f"publish.retries={cfg.publish.retries} must be >= 1, and 0 <= retry_base_s <= retry_max_s "
                     f"(got {cfg.publish.retry_base_s}, {cfg.publish.retry_max_s})")
    reg = cfg.publish.regression
    for key in ("tokens_per_s_drop", "teacher_forced_drop"):
        if not 0.0 <= getattr(reg, key) <= 1.0:
            found.append(f"publish.regression.{key}={getattr(reg, key)} must be a fraction within [0, 1]")
    for backend in reg.throughput_backends:
        found += _choice("publish.regression.throughput_backends entry", backend, ("cpu", "neuron"))
    if reg.ttft_ms_rise < 0:
        found.append(f"publish.regression.ttft_ms_rise={reg.ttft_ms_rise} must not be negative")
    if cfg.preflight.make_swap is not None:
        try:
            if parse_size(cfg.preflight.make_swap) < 1 << 30:
                found.append(f"preflight.make_swap={cfg.preflight.make_swap!r} is under 1 GiB: give a size like 64G")
        except ValueError:
            found.append(f"preflight.make_swap={cfg.preflight.make_swap!r} is not a size: write it like 64G or 512M")
    if not cfg.preflight.swap_file.startswith("/"):
        found.append(f"preflight.swap_file={cfg.preflight.swap_file!r} must be an absolute path")
    return found


def signing_problems(cfg: PipelineConfig) -> list[str]:
    from pipeline.artifact.signing import key_problem

    sig = cfg.package.signing
    found = [p for p in (
        key_problem(sig.private_key, "private", "package.signing.private_key") if sig.private_key else None,
        key_problem(sig.public_key, "public", "package.signing.public_key") if sig.public_key else None,
    ) if p]
    if not sig.allow_unsigned:
        if cfg.stage in ("all", "package", "publish") and not sig.private_key:
            found.append(f"package.signing.allow_unsigned=false but package.signing.private_key is not set: stage "
                         f"{cfg.stage!r} signs; give the key, or set allow_unsigned=true")
        elif cfg.stage == "validate" and not (sig.private_key or sig.public_key):
            found.append("package.signing.allow_unsigned=false but no key is set: give package.signing.public_key "
                         "to verify, or set allow_unsigned=true")
    return found


def available_variants(conf_dir: Path) -> list[str]:
    return sorted(p.stem for p in (conf_dir / "variant").glob("*.yaml"))


def semantic_dict(cfg: Any) -> Any:
    """A plain dict of a (sub)config: what fingerprints hash (key order never matters there)."""
    from dataclasses import asdict, is_dataclass

    if is_dataclass(cfg):
        return asdict(cfg)
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)
    return cfg
