"""The typed configuration schema, each section checking itself beside its fields, and the validation of a composed
Hydra config against it.

``structured`` merges a composed config (``conf/`` plus overrides) into the ``PipelineConfig`` dataclasses, and
``problems`` joins every section's own ``problems()`` and the rules that span sections. Turning OmegaConf's errors
into messages naming the key and its allowed values (or, for an unknown key, the nearest real one: ``unknown_key``,
which the command line also asks before Hydra composes anything) is pipeline/config_errors.py's work.
``pipeline.run.load_config`` joins them (and the stage names, which the stage registry holds) into one
``ConfigError`` listing every problem, before any stage does any work.

A setting with a fixed set of values is typed with a ``StrEnum`` (pipeline/core/choices.py), so OmegaConf refuses any
other value; its members are plain strings, so records and fingerprints hold the same strings as before.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from pipeline.artifact.formats import FORMATS
from pipeline.config_errors import merge_reporting, unknown_key_in
from pipeline.core.choices import StrEnum, values
from pipeline.core.errors import ConfigError
from pipeline.core.shape import BuildShape, Dtype
from pipeline.core.units import parse_size, visible_cores_problems
from pipeline.models.tiny_model import TinyModelConfig

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")  # "+": a variant built with overrides (run.derived_name)
REPO_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")
REVISION_RE = re.compile(r"^[0-9a-f]{40}$")
PLACEHOLDER_OWNERS = ("your-org", "your-username", "your-name", "org", "user", "username", "example")


def backend_names(folder: Path) -> list[str]:
    """The backends: one per file of conf/backend/, ``auto`` aside. A backend's conf file makes its name a choice of
    ``backend.name``; its entry in pipeline/backends/registry.py says what it is (tests/test_records.py ties them)."""
    names = sorted(p.stem for p in folder.glob("*.yaml") if p.stem != "auto")
    if not names:
        raise RuntimeError(f"no backend configuration in {folder}: the pipeline runs from its source tree, beside "
                           "its conf/ folder (pip install -e .)")
    return names


# What a build runs on: ``backend.name`` once ``auto`` is resolved, and the keys of ``model.resources`` and
# ``validate.throughput.floors``.
Backend = StrEnum("Backend", [(name, name) for name in backend_names(Path(__file__).resolve().parent.parent / "conf"
                                                                     / "backend")], module=__name__)


# backend.name: a Backend, or auto (neuron when NeuronCores and the Neuron packages are present, else cpu).
BackendChoice = StrEnum("BackendChoice", [(name, name) for name in ("auto", *values(Backend))], module=__name__)
# package.format: the archive formats pipeline/artifact/archive.py writes. OmegaConf finds a member by its name,
# and 'tar.zst' is no Python identifier: hence the functional form, members named as their values.
ArchiveFormat = StrEnum("ArchiveFormat", [(name, name) for name in FORMATS], module=__name__)


class ModelSource(StrEnum):
    """``model.source``: ``hub`` (a pinned snapshot of ``hub_id``) or ``tiny`` (generated locally from ``tiny``).
    ``tiny`` comes first: it stands in for a refused value (``structured``), and asks nothing of ``hub_id``."""

    tiny = "tiny"
    hub = "hub"


class ParityMode(StrEnum):
    """``validate.parity.<dtype>``: how a build's outputs are compared with the float reference's."""

    exact = "exact"
    teacher_forced = "teacher_forced"
    logits = "logits"


class LogitSlice(StrEnum):
    """The top-k slices of the reference's logits that ``validate.parity.logits.tol_map`` gives tolerances for."""

    top5 = "top5"
    top50 = "top50"
    top1000 = "top1000"
    all = "all"


class Context(StrEnum):
    """``validate.throughput.contexts``: short_tokens, half of kv_max, and kv_max minus the decoded tokens."""

    short = "short"
    half = "half"
    near_max = "near_max"


class PublishTarget(StrEnum):
    """``publish.target``: ``local`` (a folder laid out as the Hub repo) or ``hub``. ``local`` comes first: it stands
    in for a refused value (``structured``), and asks nothing of ``repo_id``'s owner."""

    local = "local"
    hub = "hub"


@dataclass
class ResourceNeed:
    """What building and loading one variant of a model needs on one backend, in GiB.

    In ``model.resources.<backend>`` every key is an override: unset (null), the preflight derives it from the
    checkpoint's own spec (its weights' bytes per rank, times factors measured per backend, pipeline/host/preflight.py);
    set, it wins. Set one only for what the derivation cannot know, such as a compiler release's own peak.
    build.json records the derived figures beside each trace's measured peaks."""

    trace_base_gb: float | None = None
    """The tracing process itself: reading the weights and building the graphs."""
    trace_per_graph_gb: float | None = None
    """Each graph compiled at the same time (a rank for host prefill; prefill and decode for device prefill)."""
    validate_gb: float | None = None
    """Loading a build and decoding with it."""
    host_prefill_gb: float | None = None
    """The host's prefill model that prefills host-prefill variants (validate only)."""
    disk_gb: float | None = None
    """Written per variant: compiler work files, the rank files and the archive."""

    def problems(self, key: str) -> list[str]:
        """Negative needs, each named under ``key``, where this sits (``model.resources.neuron``)."""
        return [f"{key}.{name}={value} must not be negative" for name, value in vars(self).items()
                if value is not None and value < 0]


@dataclass
class ModelConfig:
    name: str = MISSING
    """Directory name under ``artifacts_dir``; one per model."""
    source: ModelSource = ModelSource.hub
    hub_id: str | None = None
    revision: str | None = None
    """The Hub commit (40 hex digits) the snapshot is pinned to."""
    path: str | None = None
    """A local checkpoint directory to build from instead of the source."""
    text_prefix: str = "model."
    """Where the decoder's tensors live in the checkpoint (``model.language_model.`` in the multimodal release)."""
    head_key: str = "lm_head.weight"
    allow_patterns: list[str] = field(default_factory=lambda: ["*.json", "*.safetensors", "tokenizer*", "*.jinja"])
    published_repo: str = MISSING
    """The name of the repository this model's builds are published to, one per model: ``publish.repo_id``'s
    default is ``<owner>/<published_repo>`` (the embedded tiny model's demo builds go where E4B's would). Every model
    file names it: a default would send a new model's builds to another model's repository."""
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    resources: dict[Backend, ResourceNeed] = field(default_factory=dict)
    """``resources.<backend>.<key>``: overrides of what the preflight derives from the checkpoint (ResourceNeed)."""

    def __post_init__(self) -> None:
        # OmegaConf checks the nested keys but hands back plain dicts inside a dict-typed field.
        self.resources = {k: v if isinstance(v, ResourceNeed) else ResourceNeed(**v) for k, v in self.resources.items()}

    def problems(self) -> list[str]:
        found = []
        if not NAME_RE.match(self.name or ""):
            found.append(f"model.name={self.name!r} must be a plain name (letters, digits, '_', '-', '.')")
        if self.path is None and self.source == ModelSource.hub:
            if not self.hub_id or not REPO_ID_RE.match(self.hub_id):
                found.append(f"model.hub_id={self.hub_id!r} must be a Hub repo id like 'google/gemma-4-E4B-it'")
            if not self.revision or not REVISION_RE.match(self.revision):
                found.append(f"model.revision={self.revision!r} must pin a commit (40 hex digits) so builds are "
                             "reproducible")
        if self.path is not None and not Path(self.path).is_dir():
            found.append(f"model.path={self.path!r} is not a directory: point it at a checkpoint folder with "
                         "config.json")
        if not self.text_prefix.endswith("."):
            found.append(f"model.text_prefix={self.text_prefix!r} must end with '.' "
                         "(e.g. 'model.' or 'model.language_model.')")
        for backend, need in self.resources.items():
            found += need.problems(f"model.resources.{backend}")
        return found


@dataclass
class VariantConfig(BuildShape):
    """A variant's file (conf/variant/): its name and its shape, whose fields core/shape.py declares; a file may
    leave out tp_degree (2: both NeuronCores of an Inferentia2 device)."""

    tp_degree: int = 2
    name: str = MISSING

    def problems(self) -> list[str]:
        found = [] if NAME_RE.match(self.name or "") else [f"variant.name={self.name!r} must be a plain name"]
        return found + self.shape.problems()


@dataclass
class BackendConfig:
    name: BackendChoice = BackendChoice.auto
    """``cpu``, ``neuron``, ``xla`` (torch-xla's CPU device; the ``[xla]`` extra), or ``auto`` (neuron when
    NeuronCores and the Neuron packages are present, else cpu)."""
    compiler_args: dict[Dtype, list[str]] = field(default_factory=dict)
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

    def problems(self) -> list[str]:
        if self.max_parallel < 0:
            return [f"backend.max_parallel={self.max_parallel} must be 0 (all ranks) or positive"]
        return []


@dataclass
class PreflightConfig:
    check: bool = True
    """Refuse to trace or validate on a host short of memory, disk or NeuronCores (pipeline/host/preflight.py)."""
    make_swap: str | None = None
    """Create and enable a swap file of this size (e.g. ``64G``) when memory is short. Needs root."""
    swap_file: str = "/swapfile"

    def problems(self) -> list[str]:
        found = []
        if self.make_swap is not None:
            try:
                if parse_size(self.make_swap) < 1 << 30:
                    found.append(f"preflight.make_swap={self.make_swap!r} is under 1 GiB: give a size like 64G")
            except ValueError:
                found.append(f"preflight.make_swap={self.make_swap!r} is not a size: write it like 64G or 512M")
        if not self.swap_file.startswith("/"):
            found.append(f"preflight.swap_file={self.swap_file!r} must be an absolute path")
        return found


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

    def problems(self, key: str) -> list[str]:
        """Named under ``key``, where this prompt sits (``validate.prompts[0]``)."""
        return [f"{key}.max_tokens={self.max_tokens} must be at least 8"] if self.max_tokens < 8 else []


@dataclass
class LogitsConfig:
    """neuronx-distributed-inference's logit matching (pipeline/validation/parity.py)."""

    divergence_tol: float = 0.001
    tol_map: dict[LogitSlice, list[float]] = field(default_factory=lambda: {
        "top5": [1e-5, 0.01], "top50": [1e-5, 0.02], "top1000": [1e-5, 0.03], "all": [1e-5, 0.05]})
    """Per top-k slice of the reference's logits: [atol, rtol]."""
    dtype_noise: bool = True
    """bf16 only: also pass a prompt whose errors are within noise_multiplier x transformers' own bf16 errors."""
    noise_multiplier: float = 1.5

    def problems(self) -> list[str]:
        found = []
        if self.divergence_tol < 0:
            found.append(f"validate.parity.logits.divergence_tol={self.divergence_tol} must not be negative")
        if self.noise_multiplier <= 0:
            found.append(f"validate.parity.logits.noise_multiplier={self.noise_multiplier} must be positive")
        for key, pair in self.tol_map.items():
            if len(pair) != 2 or any(v < 0 for v in pair):
                found.append(f"validate.parity.logits.tol_map.{key}={list(pair)} must be [atol, rtol], both >= 0")
        return found


@dataclass
class ParityConfig:
    fp32: ParityMode = ParityMode.exact
    bf16: ParityMode = ParityMode.logits
    teacher_forced_min: float = 0.95
    logits: LogitsConfig = field(default_factory=LogitsConfig)

    def mode(self, dtype: str) -> ParityMode:
        return getattr(self, dtype)

    def problems(self) -> list[str]:
        found = self.logits.problems()
        if not 0.0 <= self.teacher_forced_min <= 1.0:
            found.append(f"validate.parity.teacher_forced_min={self.teacher_forced_min} must be within [0, 1]")
        return found


@dataclass
class FloorConfig:
    """A throughput gate. Unset (null) limits are not gated."""

    tokens_per_s: float | None = None
    """Decode tokens per second, the slowest context must reach it."""
    ttft_ms_device: float | None = None
    """Time to first token at the short context, device-prefill variants."""
    ttft_ms_host: float | None = None
    """Time to first token at the short context, host-prefill variants."""
    enforced: bool | None = None
    """Whether a figure beyond the floor fails the stage. Null: where the backend's timings compare across builds
    (``timings_compare`` in pipeline/backends/registry.py: neuron), and not on the cpu backend, whose timings are the
    machine's CPU and load (a bf16 build's first token is 30x slower on a CPU without bf16 instructions): there the
    rows are reported in validation.json and the table, not enforced."""

    def problems(self, key: str) -> list[str]:
        """Named under ``key``, where this floor sits (``validate.throughput.floors.neuron.inf2_8xlarge``)."""
        return [f"{key}.{name}={value} must be positive (or null)" for name, value in vars(self).items()
                if name != "enforced" and value is not None and value <= 0]


@dataclass
class ThroughputConfig:
    contexts: list[Context] = field(default_factory=lambda: list(Context))
    """Prompt lengths measured: short_tokens, half of kv_max, and kv_max minus the decoded tokens."""
    short_tokens: int = 16
    decode_tokens: int = 16
    runs: int = 2
    warmup_runs: int = 1
    decode_threads: int = 1
    """torch's threads on the host for each decode step (decoding/runner.py DECODE_THREADS, the default:
    bench/decode_threads.py measured the choice)."""
    floors: dict[Backend, dict[str, FloorConfig]] = field(default_factory=dict)
    """``floors.<backend>.<hardware>``; the hardware name ``any`` matches every hardware of that backend."""

    def __post_init__(self) -> None:
        self.floors = {backend: {hw: _typed_floor(f, f"validate.throughput.floors.{backend}.{hw}")
                                 for hw, f in inner.items()} for backend, inner in self.floors.items()}

    def floor(self, backend: str, hardware: str) -> tuple[str | None, FloorConfig | None]:
        by_hardware = self.floors.get(backend, {})
        for name in (hardware, "any"):
            if name in by_hardware:
                return f"{backend}.{name}", by_hardware[name]
        return None, None

    def problems(self) -> list[str]:
        found = [f"validate.throughput.{key}={value} must be at least 1" for key, value in
                 (("short_tokens", self.short_tokens), ("decode_tokens", self.decode_tokens), ("runs", self.runs),
                  ("decode_threads", self.decode_threads))
                 if value < 1]
        if self.warmup_runs < 0:
            found.append(f"validate.throughput.warmup_runs={self.warmup_runs} must be 0 or more")
        for backend, by_hardware in self.floors.items():
            for hardware, floor in by_hardware.items():
                found += floor.problems(f"validate.throughput.floors.{backend}.{hardware}")
        return found


def _typed_floor(floor: FloorConfig | dict, key: str) -> FloorConfig:
    """OmegaConf types only the first level of a dict of dicts (omry/omegaconf#1019), so the floors come as plain
    dicts, unchecked: checked here, an error naming its full key so that ``structured`` reports it as any other."""
    if isinstance(floor, FloorConfig):
        return floor
    try:
        typed = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(FloorConfig), floor))
    except OmegaConfBaseException as exc:
        exc.full_key = f"{key}.{exc.full_key}"
        raise
    # A number keeps the form it was written in (30, not 30.0): the validate stage's fingerprint hashes it.
    return dataclasses.replace(typed, **{k: v for k, v in floor.items() if isinstance(v, (int, float))})


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

    def problems(self) -> list[str]:
        found = []
        if self.max_new_tokens < 1:
            found.append(f"validate.max_new_tokens={self.max_new_tokens} must be at least 1")
        if self.warmup_prompts < 0:
            found.append(f"validate.warmup_prompts={self.warmup_prompts} must be 0 or more")
        found += self._prompt_problems()
        return found + self.parity.problems() + self.throughput.problems()

    def _prompt_problems(self) -> list[str]:
        names = [p.name for p in self.prompts]
        found = [] if self.prompts else ["validate.prompts is empty: validation needs at least one prompt"]
        if len(set(names)) != len(names):
            found.append(f"validate.prompts names must be unique, got {names}")
        for i, prompt in enumerate(self.prompts):
            found += prompt.problems(f"validate.prompts[{i}]")
        unknown = sorted(set(self.prompt_names or ()) - set(names))
        if unknown:
            found.append(f"validate.prompt_names {unknown} are not in validate.prompts ({names})")
        return found


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

    def problems(self) -> list[str]:
        """Keys that cannot be read as PEM elliptic-curve keys (whether a stage needs one: ``problems``)."""
        from pipeline.artifact.signing import key_problem

        found = (key_problem(path, kind, f"package.signing.{kind}_key")
                 for kind, path in (("private", self.private_key), ("public", self.public_key)) if path)
        return [p for p in found if p]


@dataclass
class PackageConfig:
    format: ArchiveFormat = ArchiveFormat["tar.zst"]
    threads: int = 0
    """zstd worker threads (0: one per core). The archive's bytes do not depend on it."""
    signing: SigningConfig = field(default_factory=SigningConfig)

    def problems(self) -> list[str]:
        found = [f"package.threads={self.threads} must be 0 (one per core) or positive"] if self.threads < 0 else []
        return found + self.signing.problems()


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
    throughput_backends: list[Backend] | None = None
    """Backends whose throughput is compared; null: those whose timings are steady enough (their entry's
    ``timings_compare``: neuron). The cpu backend's timings swing with the machine's load by tens of percent between
    runs, so by default only its parity is compared."""

    def problems(self) -> list[str]:
        found = [f"publish.regression.{key}={getattr(self, key)} must be a fraction within [0, 1]"
                 for key in ("tokens_per_s_drop", "teacher_forced_drop") if not 0.0 <= getattr(self, key) <= 1.0]
        if self.ttft_ms_rise < 0:
            found.append(f"publish.regression.ttft_ms_rise={self.ttft_ms_rise} must not be negative")
        return found


@dataclass
class PublishConfig:
    target: PublishTarget = PublishTarget.local
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
    index_expiry_days: float = 7.0
    """How long a consumer with the public key takes the repository's signed index (versions.json) after it was
    written: past it, an index nobody refreshed is refused (a freeze). ``refresh-index`` (the scheduled rebuild runs
    it daily) writes it again when less than half of this is left."""

    def problems(self) -> list[str]:
        found = self._repo_problems()
        if not 1 <= self.index_expiry_days <= 366:
            found.append(f"publish.index_expiry_days={self.index_expiry_days} must be between 1 and 366 days: the "
                         "scheduled refresh runs daily, and an index that never expires is no bound on a freeze")
        if self.retries < 1 or self.retry_base_s < 0 or self.retry_max_s < self.retry_base_s:
            found.append(f"publish.retries={self.retries} must be >= 1, and 0 <= retry_base_s <= retry_max_s "
                         f"(got {self.retry_base_s}, {self.retry_max_s})")
        return found + self.regression.problems()

    def placeholder_problem(self) -> str | None:
        """The documentation's placeholder as the Hub repository: refused before a build that would publish there
        (with the token and the demo rule: stages/publish.py ``target_problems``), not when nothing publishes."""
        if self.target == PublishTarget.hub and (self.repo_id or "").split("/")[0] in PLACEHOLDER_OWNERS:
            return (f"publish.repo_id={self.repo_id!r} is the documentation's placeholder: set it to the repository "
                    "to publish to, publish.repo_id=<your org>/<repo>")
        return None

    def _repo_problems(self) -> list[str]:
        repo_id, found = self.repo_id or "", []
        if self.target == PublishTarget.hub and "/" not in repo_id:
            found.append(f"publish.repo_id={self.repo_id!r} names no owner: publish=hub needs 'owner/name'")
        if not REPO_ID_RE.match(repo_id) or len(repo_id) > 96:
            found.append(f"publish.repo_id={self.repo_id!r} must look like 'name' or 'owner/name' (letters, "
                         "digits, '-', '_', '.')")
        return found


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
    # The folder under artifacts_dir/<model>/ a variant's build and records go to; None: the variant's name. dvc.yaml's
    # sweep stages set sweep-<base>, so every experiment of a knob sweep writes the same paths (one column each in
    # `dvc exp show`) while its version is still named after what it is (512_fp32+kv768).
    variant_folder: str | None = None

    @property
    def root(self) -> Path:
        """``artifacts_dir``; every path under it is pipeline/paths.py's."""
        return Path(self.artifacts_dir)


# -- checking a typed config ------------------------------------------------------------------------------------------

def problems(cfg: PipelineConfig) -> list[str]:
    """Every semantic problem of a typed config, each naming the key and the fix: each section's own, then the
    rules between sections."""
    sections = (cfg.model, cfg.variant, cfg.backend, cfg.validate, cfg.package, cfg.publish, cfg.preflight)
    found = [p for section in sections if section is not None for p in section.problems()]
    return found + _cores_for_variant(cfg) + _signing_for_stage(cfg) + _variant_folder(cfg)


def _variant_folder(cfg: PipelineConfig) -> list[str]:
    """variant_folder is one plain folder name, for a build of one variant."""
    folder = cfg.variant_folder
    if folder is None:
        return []
    if cfg.variant is None:
        return [f"variant_folder={folder}: it names one variant's folder; add +variant=NAME"]
    if not re.fullmatch(r"[A-Za-z0-9_+-][A-Za-z0-9_.+-]*", folder):
        return [f"variant_folder={folder!r} is not a folder name: letters, digits and _ . + - (no '/'), e.g. "
                "sweep-512_fp32"]
    return []


def _cores_for_variant(cfg: PipelineConfig) -> list[str]:
    """backend.visible_cores names exactly variant.tp_degree NeuronCores."""
    if cfg.backend.visible_cores is None or cfg.variant is None:
        return []
    return visible_cores_problems(cfg.backend.visible_cores, cfg.variant.tp_degree, None)


def _signing_for_stage(cfg: PipelineConfig) -> list[str]:
    """A stage that signs has a private key, and validate a key to verify with, unless unsigned builds are allowed."""
    sig = cfg.package.signing
    if sig.allow_unsigned:
        return []
    if cfg.stage in ("all", "package", "publish") and not sig.private_key:
        return [f"package.signing.allow_unsigned=false but package.signing.private_key is not set: stage "
                f"{cfg.stage!r} signs; give the key, or set allow_unsigned=true"]
    if cfg.stage == "validate" and not (sig.private_key or sig.public_key):
        return ["package.signing.allow_unsigned=false but no key is set: give package.signing.public_key "
                "to verify, or set allow_unsigned=true"]
    return []


# -- merging a composed config into the schema ------------------------------------------------------------------------

def structured(cfg: DictConfig | dict) -> PipelineConfig:
    """Merge into the schema and convert to dataclasses.

    Every type error and unknown key becomes one line of a ``ConfigError``, together with the semantic problems of
    the rest of the config, so one run names them all (how the rest is checked: config_errors.py ``merge_reporting``).
    """
    data = OmegaConf.to_container(cfg, resolve=False) if isinstance(cfg, DictConfig) else copy.deepcopy(cfg)
    typed, found = merge_reporting(PipelineConfig, data)
    if found:
        raise ConfigError(found + (problems(typed) if typed is not None else []))
    return typed


T = TypeVar("T")


def section(schema: type[T], data: dict, key: str) -> T:
    """The section ``key`` of the schema (``validate.parity``, ``validate.throughput``) from its plain form
    (``dataclasses.asdict``), typed and checked as the composed configuration is (its types, then its own problems):
    what a process handed the section as JSON reads back (pipeline/validation/worker.py)."""
    typed, found = merge_reporting(schema, copy.deepcopy(data))
    found = [f"{key}.{problem}" for problem in found]
    if typed is not None:
        found += typed.problems()
    if found:
        raise ConfigError(found)
    return typed


def unknown_key(full_key: str) -> str | None:
    """Why ``full_key`` (``validate.max_new_tokenz``) is no key of ``PipelineConfig``, naming the nearest real key,
    or None when it is one (config_errors.py ``unknown_key_in``)."""
    return unknown_key_in(PipelineConfig, full_key)


# -- helpers for other modules ----------------------------------------------------------------------------------------

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
