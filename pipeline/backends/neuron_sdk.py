"""The Neuron SDK releases this pipeline knows: which package versions make up each one, and what it may build.

One table, read everywhere: the ``[neuron]`` extra in pyproject.toml pins one row (a test ties them), the neuron
backend refuses an installed mix of packages that is not exactly one row before any compile, and host prefill is
decided by the row.

Versions are those of the Neuron release manifest (aws-neuron/aws-neuron-sdk ``src/helperscripts/n2-manifest.json``,
manifest 2.32.0 of 2026-08-17, the same entries at each release's tag; the 2.30/2.31 setup pages pin the same
torch-neuronx and neuronx-cc); neuronx-distributed's own ``_version.py`` agrees at each release commit (0.12.0 at
2.23, 0.14.0 at 2.25, 0.15.0 at 2.26, 0.16.0 at 2.27, 0.17.0 at 2.28, 0.18.0 at 2.29; no 2.30/2.31 source is
public). torch-neuronx is built for several torch versions
per release (``2.8.0.2.12.22436`` is torch 2.8.0's build of release 2.28); the extra takes the torch 2.8 one, the
front end the seed recipe ran.

Host prefill compiles with ``parallel_model_trace``, which Neuron documents as no longer supported from 2.27 on
(about-neuron/announcements/neuron2.x/announcement-end-of-support-parallel-model-trace.rst) though it is still
exported through NxD 0.18. The pipeline builds host-prefill variants on the releases that support it (up to 2.26)
and on 2.28, where the seed recipe built and served E4B's host-prefill variants (neuronx-cc 2.23.6484.0,
neuronx-distributed 0.17); on any other release it refuses them unless ``backend.allow_unsupported_host_prefill``
is set, since nothing has shown that they work there.
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.version import InvalidVersion, Version

SUPPORTED, VERIFIED, UNSUPPORTED = "supported", "unsupported by Neuron, verified by the seed recipe", "unsupported"
PACKAGES = ("torch-neuronx", "neuronx-cc", "neuronx-distributed", "libneuronxla")
NEURON_INDEX = "https://pip.repos.neuron.amazonaws.com"
INSTALL = (f"deploy/install-inf2.sh (every file by sha256; in an environment that has the pipeline: python -m "
           f"pipeline install-neuron --release {{release}}), never pip's --extra-index-url {NEURON_INDEX}, which lets "
           "another index's higher version of a Neuron-only name win (docs/inf2-host.md, 'On an inf2 host')")
"""How to install a release, for every message that says to (``INSTALL.format(release=...)``)."""


@dataclass(frozen=True)
class SdkRelease:
    release: str
    torch_neuronx: tuple[str, ...]  # one build per supported torch version
    neuronx_cc: str
    neuronx_distributed: str
    libneuronxla: str
    host_prefill: str

    def versions(self) -> dict[str, tuple[str, ...]]:
        return {"torch-neuronx": self.torch_neuronx, "neuronx-cc": (self.neuronx_cc,),
                "neuronx-distributed": (self.neuronx_distributed,), "libneuronxla": (self.libneuronxla,)}

    def matches(self, installed: dict[str, str | None]) -> bool:
        return all(release_part(installed.get(name)) in allowed for name, allowed in self.versions().items())

    def torch_neuronx_for(self, torch_version: str) -> str | None:
        """The torch-neuronx build of this release for ``torch_version`` (``2.8.0`` -> ``2.8.0.2.12.22436``)."""
        return next((v for v in self.torch_neuronx if v.startswith(torch_version + ".")), None)

    def exact_versions(self, torch_version: str) -> dict[str, str] | None:
        """Each package's version in this release, with ``torch_version``'s torch-neuronx build (None: the release
        has no build for that torch)."""
        build = self.torch_neuronx_for(torch_version)
        if build is None:
            return None
        return {"torch-neuronx": build, "neuronx-cc": self.neuronx_cc, "neuronx-distributed": self.neuronx_distributed,
                "libneuronxla": self.libneuronxla}


RELEASES = (
    SdkRelease("2.23.0", ("2.5.1.2.7.5413", "2.6.0.2.7.5413"), "2.18.121.0", "0.12.12111", "2.2.3493.0", SUPPORTED),
    SdkRelease("2.24.1", ("2.5.1.2.8.6734", "2.6.0.2.8.6734", "2.7.0.2.8.6734"), "2.19.8089.0", "0.13.14393",
               "2.2.4410.0", SUPPORTED),
    SdkRelease("2.25.0", ("2.6.0.2.9.9357", "2.7.0.2.9.9357"), "2.20.9961.0", "0.14.18461", "2.2.8201.0", SUPPORTED),
    SdkRelease("2.26.0", ("2.6.0.2.10.13553", "2.7.0.2.10.13553", "2.8.0.2.10.13553"), "2.21.18209.0",
               "0.15.22404", "2.2.12677.0", SUPPORTED),
    SdkRelease("2.26.1", ("2.6.0.2.10.16998", "2.7.0.2.10.16998", "2.8.0.2.10.16998"), "2.21.33363.0",
               "0.15.22404", "2.2.12677.0", SUPPORTED),
    SdkRelease("2.27.1", ("2.7.0.2.11.19912", "2.8.0.2.11.19912", "2.9.0.2.11.19912"), "2.22.12471.0",
               "0.16.25997", "2.2.14584.0", UNSUPPORTED),
    # 2.28.0 and 2.28.1 ship the same pip packages; the pins name 2.28.1.
    SdkRelease("2.28.1", ("2.7.0.2.12.22436", "2.8.0.2.12.22436", "2.9.0.2.12.22436"), "2.23.6484.0",
               "0.17.26814", "2.2.15515.0", VERIFIED),
    SdkRelease("2.29.0", ("2.9.0.2.13.24727",), "2.24.5133.0", "0.18.27753", "2.2.16408.0", UNSUPPORTED),
    SdkRelease("2.29.1", ("2.9.0.2.13.26312",), "2.24.8799.0", "0.18.27753", "2.2.16408.0", UNSUPPORTED),
    # From 2.30 the manifest also lists libneuronxla 3.0.x, the native-PyTorch stack's; torch-neuronx's is 2.2.x.
    # These releases need Python 3.11-3.13 (3.10 ended at 2.30: announcement-python-3-10-eol); the contract data
    # cannot cover them (neuronx-distributed 0.19's source is not on GitHub).
    SdkRelease("2.30.0", ("2.9.0.2.14.27725",), "2.25.3371.0", "0.19.28093", "2.2.16974.0", UNSUPPORTED),
    # 2.31.0 and 2.31.1 ship the same pip packages (2.31.1 changed aws-neuron-tools only); the row names 2.31.0.
    SdkRelease("2.31.0", ("2.9.0.2.15.32035",), "2.26.6360.0", "0.19.28492", "2.2.17544.0", UNSUPPORTED),
)
FINAL_LINE = "2.31"
"""The last release line with torch-neuronx and neuronx-distributed for Inf2: from 2.32 Neuron ships neither (the
2.32 setup pages: torch-neuronx "is not included in Neuron 2.32.0 ... use ... Neuron 2.31";
about-neuron/announcements/neuron2.x/announce-nxdi-maintenance-support-2-31.rst: NxD Core 0.19.28492 "will continue to
be supported with critical bug fixes and security patches. No new releases are planned."). Only 2.31's own patch
releases can be added below it."""
FINAL_NOTICE = (f"Neuron SDK {FINAL_LINE} is the last release line with torch-neuronx and neuronx-distributed for "
                f"Inf2 (from 2.32 Neuron ships neither; NxD is kept at {FINAL_LINE} with security and critical fixes "
                "only, announce-nxdi-maintenance-support-2-31): no newer release will support this hardware. "
                f"{FINAL_LINE}'s own patch releases are still added to the table and rebuilt")
PINNED = "2.28.1"
"""The release the ``[neuron]`` extra installs (with torch 2.8.0's torch-neuronx build)."""
PINNED_TORCH = "2.8.0"


def release(name: str) -> SdkRelease:
    return next(r for r in RELEASES if r.release == name)


def pinned_requirements() -> list[str]:
    """The ``[neuron]`` extra's Neuron pins, as pyproject.toml must spell them."""
    pins = release(PINNED).exact_versions(PINNED_TORCH)
    return [f"{name}=={version}" for name, version in pins.items()] + [f"torch=={PINNED_TORCH}"]


def installed_versions() -> dict[str, str | None]:
    from pipeline.core.versions import installed

    return {name: installed(name) for name in PACKAGES}


def release_part(version: str | None) -> str | None:
    """``2.23.6484.0+f702b353`` -> ``2.23.6484.0``: Neuron's wheels carry a build hash as a local version, which the
    release manifest does not (and ``2.23.6484.0`` matches either)."""
    if version is None:
        return None
    try:
        return Version(version).public
    except InvalidVersion:
        return version


def identify(installed: dict[str, str | None]) -> SdkRelease | None:
    return next((r for r in RELEASES if r.matches(installed)), None)


def mix_problem(installed: dict[str, str | None]) -> str | None:
    """Why ``installed`` is not exactly one known release (None when it is)."""
    if identify(installed) is not None:
        return None
    have = ", ".join(f"{name} {installed.get(name) or '(absent)'}" for name in PACKAGES)
    same_cc = [r.release for r in RELEASES if r.neuronx_cc == release_part(installed.get("neuronx-cc"))]
    hint = (f" (neuronx-cc {installed.get('neuronx-cc')} belongs to release {same_cc[-1]})" if same_cc else
            " (a release newer than this pipeline knows? add its row to pipeline/backends/neuron_sdk.py from the "
            "Neuron release manifest)")
    return (f"the installed Neuron packages are not one Neuron SDK release: {have}{hint}. Mixed releases compile "
            f"and load unpredictably: install one release, e.g. the tested one, {PINNED}: "
            f"{INSTALL.format(release=PINNED)}; backend.check_sdk_release=false skips this check at your own risk")


def host_prefill_problem(row: SdkRelease, allow_unsupported: bool) -> str | None:
    """Why host prefill is refused on ``row`` (None when it is built)."""
    if row.host_prefill != UNSUPPORTED or allow_unsupported:
        return None
    verified = [r.release for r in RELEASES if r.host_prefill == VERIFIED]
    return (f"prefill=host variants compile with parallel_model_trace, which Neuron no longer supports from SDK 2.27 "
            f"on, and nothing has shown it to work on the installed SDK {row.release}: build the device-prefill "
            f"variants (512_bf16, 2048_bf16, ...), or install an SDK where host prefill is known to work "
            f"({', '.join(verified)}, the [neuron] extra's), or set backend.allow_unsupported_host_prefill=true to try "
            "it (the build is validated like any other before it can ship)")
