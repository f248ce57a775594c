"""Whether a published version fits this host: compatible, compatible with a warning, or refused. The one rule that
``pull``, ``serve`` and ``versions`` apply, from two toolchain records of the same format (the toolchain stage's
``collect``): the one the version was built with (its manifest's ``toolchain``) and this host's.

Builds of a backend whose entry says ``fits_by_neuron_release`` (neuron), by the Neuron SDK release each record's
packages make up (pipeline/backends/neuron_sdk.py's table):

- **refused** when this host has no Neuron packages, when its torch-neuronx is built for another torch than the
  version's (the rank files are TorchScript saved by that torch, with torch-neuronx's operators in them), when this
  host's SDK release is older than the version's (a NEFF from a newer neuronx-cc can need a newer runtime: the Neuron
  runtime's release notes, "NEFF Support Table", give each NEFF version the runtime versions that load it, open above
  and closed below), or when its ``aws-neuronx-runtime-lib`` is older than the one the version was validated with;
- **compatible with a warning** when this host's release is newer (a newer runtime loads the NEFFs of older compilers:
  the same table, and the runtime FAQ, "Do I need to recompile my model to use the Runtime Library?") or one this
  pipeline does not know: the version was validated on another release than this host runs;
- **compatible** on exactly the version's release (and runtime).

Every other build (cpu, xla) is TorchScript run by torch: refused on an older torch than the version's (an older
torch may not read what a newer one saved), a warning on a newer one or another patch release, compatible on the
same torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

from pipeline.backends import neuron_sdk
from pipeline.backends.registry import backend_entry
from pipeline.core.build_records import ToolchainRecord
from pipeline.core.choices import StrEnum

RUNTIME_PACKAGE = "aws-neuronx-runtime-lib"


class Fit(StrEnum):
    compatible = "compatible"
    warning = "compatible with a warning"
    refused = "refused"


@dataclass(frozen=True)
class Verdict:
    fit: Fit
    reason: str
    """Why (for a compatible version, what matched)."""
    fix: str = ""
    """The command or step that makes this host fit (empty unless refused)."""

    def says(self) -> str:
        return self.reason + (f"; to fix: {self.fix}" if self.fix else "")


def _version(text: str | None) -> Version | None:
    """A package's version; a Debian or RPM one (``2.22.19.0-5856c2f36``) by its upstream part."""
    try:
        return Version(text.split("-")[0]) if text else None
    except InvalidVersion:
        return None


def judge(backend: str, built: ToolchainRecord, host: ToolchainRecord) -> Verdict:
    """The rule (this module's docstring) for a version of ``backend`` built with toolchain ``built``, on ``host``."""
    if backend_entry(backend).fits_by_neuron_release:
        return _judge_neuron(built, host)
    return _judge_torch(built.version("torch"), host.version("torch"))


def _judge_torch(built: str | None, host: str | None) -> Verdict:
    want, have = _version(built), _version(host)
    if want is None:
        return Verdict(Fit.warning, f"the version does not record its torch ({built!r})")
    if have is None:
        return Verdict(Fit.refused, "this environment has no torch", f"pip install torch=={want.public}")
    said = f"built with torch {built}, this environment has torch {host}"
    if have.release[:2] < want.release[:2]:
        return Verdict(Fit.refused, f"{said}: an older torch may not read what a newer one saved",
                       f"pip install torch=={want.public} (or a newer release)")
    if have.public != want.public:
        return Verdict(Fit.warning, f"{said}: a newer torch reads it, but it was validated with {want.public}")
    return Verdict(Fit.compatible, f"torch {host}")


def _judge_neuron(built: ToolchainRecord, host: ToolchainRecord) -> Verdict:
    want, have = built.wheel_versions(), host.wheel_versions()
    want_release, have_release = neuron_sdk.identify(want), neuron_sdk.identify(have)
    install = neuron_sdk.INSTALL.format(release=want_release.release if want_release else neuron_sdk.PINNED)
    if not have.get("torch-neuronx"):
        return Verdict(Fit.refused, "this host has no Neuron packages (torch-neuronx)", install)
    built_torch = (want.get("torch-neuronx") or "").split(".")[:3]
    if built_torch != have["torch-neuronx"].split(".")[:3]:
        return Verdict(Fit.refused, f"built with torch-neuronx {want.get('torch-neuronx')}, this host has "
                       f"{have['torch-neuronx']}: the rank files are TorchScript of torch {'.'.join(built_torch)}",
                       install)
    runtime = _runtime_problem(built, host)
    if runtime:
        return Verdict(Fit.refused, runtime, f"apt-get install {RUNTIME_PACKAGE}="
                       f"{built.system_packages.get(RUNTIME_PACKAGE)} (or the release's: {install})")
    if want_release is None:
        return Verdict(Fit.warning, f"built with Neuron packages that are no release this pipeline knows "
                       f"({_listed(want)})")
    if have_release is None:
        return Verdict(Fit.warning, f"this host's Neuron packages are no release this pipeline knows "
                       f"({_listed(have)}); the version was built and validated on SDK {want_release.release}")
    said = f"built on Neuron SDK {want_release.release} (neuronx-cc {want_release.neuronx_cc}), this host has " \
           f"{have_release.release} (neuronx-cc {have_release.neuronx_cc})"
    if Version(have_release.release) < Version(want_release.release):
        return Verdict(Fit.refused, f"{said}: its NEFFs can need a newer runtime than this release's", install)
    if have_release.release != want_release.release:
        return Verdict(Fit.warning, f"{said}: a newer runtime loads the NEFFs of older compilers, but it was "
                       f"validated on {want_release.release}")
    return Verdict(Fit.compatible, f"Neuron SDK {have_release.release}")


def _runtime_problem(built: ToolchainRecord, host: ToolchainRecord) -> str | None:
    """Why this host's runtime library is older than the one the version was validated with (None when it is not,
    or when either is not known: a host without dpkg or rpm records none)."""
    want = _version(built.system_packages.get(RUNTIME_PACKAGE))
    have = _version(host.system_packages.get(RUNTIME_PACKAGE))
    if want is None or have is None or have >= want:
        return None
    return f"this host's {RUNTIME_PACKAGE} {have} is older than the {want} the version was validated with"


def _listed(versions: dict[str, str | None]) -> str:
    return ", ".join(f"{name} {versions.get(name) or '(absent)'}" for name in neuron_sdk.PACKAGES)
