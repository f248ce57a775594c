"""The records the build stages hand on, typed: ``toolchain.json`` (written by the toolchain stage, read by trace and,
through the manifest, by pull's compatibility rule), ``model.json`` (written by the model stage, read by trace and
reference) and ``build.json`` (written by trace, read by package and ``neuron-check``), and the parts of them the
manifest (pipeline/artifact/manifest.py) repeats.

Each is read and written through its class only (``Record.read`` / ``write``, pipeline/core/records.py): a record with
a missing, unknown or wrong-typed key is refused, naming the file, the key and the stage to run again. On disk a record
is exactly its fields as JSON, keys sorted.

They live in core, beside the shape, so that the stages writing and reading them and the manifest can all import them;
like the rest of core they are plumbing to the stage fingerprints (pipeline/stages, CODE): a schema change does not
rebuild anything by itself, but a record an older release wrote and this one cannot read is not trusted as up to date
(``Record.read_if_valid``), so its stage runs again.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from pipeline.core.records import Record, added, encode
from pipeline.core.shape import BuildShape


@dataclass(frozen=True)
class PackageVersion:
    version: str | None
    """Null: the package is not installed."""


@dataclass(frozen=True)
class NeuronxCcBuild:
    """neuronx-cc's full version, with the build hash the Neuron compile cache keys on (null: not installed)."""

    version: str | None
    source: str | None
    """Where it was read: ``neuronxcc.__version__`` or ``neuronx-cc --version``."""


@dataclass(frozen=True)
class ToolchainRecord(Record):
    """``toolchain.json``: the installed versions that shape a build (pipeline/stages/toolchain.py collects them). A
    build records the one it was made with, and a manifest repeats it: what pull judges a host against."""

    KIND = "toolchain record"
    MAKE = "run stage=toolchain first"
    FIX = "It was written by another release of the pipeline: run stage=toolchain"
    SCHEMA_VERSION = 2

    schema_version: int
    backend: str
    packages: dict[str, PackageVersion]
    """Every Python package the toolchain stage looks for, by name."""
    neuronx_cc: NeuronxCcBuild
    system_packages: dict[str, str]
    """The host's ``aws-neuronx-*`` packages (driver, runtime), by name."""

    def version(self, package: str) -> str | None:
        """A Python package's version (its wheel's); None when it is not installed or not one the record looks
        for."""
        found = self.packages.get(package)
        return found.version if found else None

    def wheel_versions(self) -> dict[str, str | None]:
        """Every package's version as its wheel's metadata gives it (what a Neuron SDK release lists)."""
        return {name: entry.version for name, entry in self.packages.items()}

    def compiler_versions(self) -> dict[str, str | None]:
        """Every package's version, neuronx-cc's with its build hash where the record knows it (what a build's
        ``compiler.versions`` records)."""
        found = self.wheel_versions()
        if self.neuronx_cc.version:
            found["neuronx-cc"] = self.neuronx_cc.version
        return found


@dataclass(frozen=True)
class Member:
    """A rank file: its name in the build directory (and under the archive's root), its size and sha256."""

    path: str
    size: int
    sha256: str


@dataclass(frozen=True)
class TraceResult:
    """What a backend's ``trace`` built (``Backend.trace`` returns it; build.json's ``trace`` records it): the files,
    their layout and the largest trace process's peak RSS, which the trace stage reads, and the backend's own account
    of how (``details``: its compiler and versions, times, per-rank figures), recorded as it is."""

    members: tuple[Member, ...]
    layout: str
    """``per_rank`` (one ``tp_N.pt`` per rank) or ``nxd_model`` (one ``model.pt``)."""
    peak_rss_bytes: int
    details: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        """build.json's ``trace``: one object, the typed fields beside the backend's own keys."""
        typed = {f.name: encode(getattr(self, f.name)) for f in fields(self) if f.name != "details"}
        clash = sorted(set(typed) & set(self.details))
        if clash:
            raise ValueError(f"a backend's trace details repeat the typed fields {clash}")
        return typed | self.details


@dataclass
class Variant(BuildShape):
    """The variant a build was made for: its shape (the fields that decide what is traced) and its name."""

    name: str = field(kw_only=True)  # after the shape's fields, the last of which have defaults


@dataclass(frozen=True)
class Compiler:
    """The compiler a build was made with: its id (the version's middle part), exact arguments and package versions
    (null for a package that is not installed)."""

    id: str
    args: tuple[str, ...]
    versions: dict[str, str | None]


@dataclass(frozen=True)
class ModelIdentity:
    """The checkpoint a build was made from (``hub_id`` and ``revision`` are null for the embedded tiny model)."""

    name: str
    hub_id: str | None
    revision: str | None
    config_digest: str
    weights_digest: str


@dataclass(frozen=True)
class FileDigest:
    size: int
    sha256: str


@dataclass(frozen=True)
class SpecSummary:
    """The model's shape as model.json records it for a reader (pipeline/stages/model.py, ``summary``)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    sliding_window: int
    ple_dim: int
    head_dims: tuple[int, ...]
    kv_heads: tuple[int, ...]
    kv_producers: tuple[int, ...]
    final_logit_softcapping: float | None


@dataclass(frozen=True)
class ModelRecord(Record):
    """``model.json``: the checkpoint in ``weights/``, where it came from, and the fingerprint downstream stages build
    on."""

    KIND = "model record"
    MAKE = "run stage=model first"
    FIX = "It was written by another release of the pipeline, or edited: run stage=model force=true"

    fingerprint: str
    source_fingerprint: str
    """The checkpoint source's alone (not the code's): the same files, recorded again by changed code, are not
    fetched again."""
    name: str
    source: str
    hub_id: str | None
    revision: str | None
    text_prefix: str
    head_key: str
    config_digest: str
    weights_digest: str
    files: dict[str, FileDigest]
    """Every file of ``weights/`` by name."""
    spec: SpecSummary

    @property
    def identity(self) -> ModelIdentity:
        return ModelIdentity(self.name, self.hub_id, self.revision, self.config_digest, self.weights_digest)


# -- the preflight's figures, as the records keep them ----------------------------------------------------------------
# pipeline/host/preflight.py makes them; build.json, validation.json and reference.json record them beside what the
# stage then measured, so that its factors can be derived again from real runs.

@dataclass(frozen=True)
class WeightBytes:
    """The weights a variant's processes hold, in bytes: what its memory and disk needs grow with."""

    rank: int
    """One rank's tensors at the variant's dtype (``ShardPlan.rank_bytes``): what a rank's trace or load holds."""
    tp_degree: int
    largest: int
    """The largest of those tensors (``ShardPlan.largest_tensor_bytes``): a rank file's rewrite holds one at once."""
    host_prefill: int
    """The host's prefill model of a host-prefill variant: the whole decoder as one rank at the variant's dtype
    (pipeline/recipe/host.py)."""
    host_float: int
    """The same decoder in fp32: what the float reference holds (pipeline/stages/reference.py; the per-layer table
    stays mapped in its file, and a tied head is the token table)."""
    batch_kv: int = added(default=0)
    """One rank's KV caches of the lines beyond the first (``batch_size - 1`` sequences, ``ShardPlan.rank_kv_bytes``):
    what a batched build's trace and load hold beyond a batch-1 build's, whose caches the measured factors include
    (0 at batch 1, and in a record from before batching)."""

    @property
    def ranks(self) -> int:
        return self.rank * self.tp_degree


@dataclass(frozen=True)
class NeedFigures:
    """What a stage was checked for (host.preflight ``Need``), in GiB."""

    memory_gib: float
    neuron_cores: int
    disk_gib: dict[str, float]
    """By the path written."""


@dataclass(frozen=True)
class HostFigures:
    """What the host offered when it was checked (host.preflight ``Resources``), in GiB."""

    mem_available_gib: float
    swap_free_gib: float
    cgroup_limit_gib: float | None
    usable_memory_gib: float
    disk_free_gib: dict[str, float]
    """By the path written."""
    neuron_cores: int | None
    """None: neuron-ls is absent."""
    neuron_cores_busy: int


@dataclass(frozen=True)
class EstimateFigures:
    """What the need was derived from (host.preflight ``Estimate``)."""

    weights_bytes: WeightBytes
    resources_gb: dict[str, float]
    """The derived ``model.resources.<backend>`` (config.py ResourceNeed), by its field."""
    overridden: tuple[str, ...]
    """The fields of it the configuration set."""


@dataclass(frozen=True)
class TracePeaks:
    stage_peak_rss_bytes: int
    graph_peak_rss_bytes: int
    """The largest trace process's."""
    written_bytes: int
    """The rank files'."""


@dataclass(frozen=True)
class CheckedFigures:
    """A check a stage passed: what it needed, what the host offered, and what the need was derived from."""

    need: NeedFigures
    host: HostFigures
    estimate: EstimateFigures


@dataclass(frozen=True)
class TracePreflight(CheckedFigures):
    """build.json's ``preflight``: the check the trace passed, and what the trace then measured."""

    measured: TracePeaks


@dataclass(frozen=True)
class BuildRecord(Record):
    """``build.json``: what the trace built, from what and how, and each rank file's checksum."""

    KIND = "build record"
    MAKE = "run stage=trace first"
    FIX = "It was written by another release of the pipeline, or edited: rebuild with stage=trace force=true"

    fingerprint: str
    inputs_digest: str
    """What decides the rank files' bytes (stages/trace.py, inputs_digest): the version's last part starts from it."""
    variant: Variant
    backend: str
    layout: str
    """``per_rank`` (one ``tp_N.pt`` per rank) or ``nxd_model`` (one ``model.pt``)."""
    compiler: Compiler
    toolchain: ToolchainRecord
    """The toolchain record the build was made with (artifacts/toolchain.json)."""
    preflight: TracePreflight
    trace: dict[str, Any]
    """The backend's account of the trace: API, times, peak RSS per rank."""
    members: tuple[Member, ...]
    model: ModelIdentity

    @property
    def shape(self) -> BuildShape:
        return self.variant.shape


@dataclass(frozen=True)
class PublishReceipt(Record):
    """``publish.json``: where the publish stage put a version (written when it changed: DVC and make see its mtime)."""

    KIND = "publish receipt"
    MAKE = "run stage=publish first"
    FIX = "It was written by another release of the pipeline, or edited: run stage=publish force=true"

    target: str
    """``local`` or ``hub`` (``publish.target``)."""
    repo: str
    """The folder or the Hub repository it went to."""
    version: str
    tag: str
    commit: str
    fingerprint: str
    archive_sha256: str
