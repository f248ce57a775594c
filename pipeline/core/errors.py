"""Domain exceptions. Each message names the setting at fault and how to fix it.

A child process (the validation worker) reports its failure as an ``ErrorRecord`` in its RESULT.json, and the stage
raises it again (``raised_again``): a ParityError in the child is a ParityError in the stage.
"""

from __future__ import annotations

from dataclasses import dataclass


class PipelineError(Exception):
    """Base class for every error the pipeline reports to a user (exit code 1, no traceback)."""


class ConfigError(PipelineError):
    """A composed configuration is invalid. Raised before any work starts."""

    def __init__(self, problems: list[str] | str):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("invalid configuration:\n" + "\n".join(f"  - {p}" for p in self.problems))


class CheckpointError(PipelineError):
    """A checkpoint is missing a tensor, has an unexpected one, or a wrong shape."""


class UnsupportedModelError(PipelineError):
    """The checkpoint uses an architecture feature the recipe does not implement."""


class InputError(PipelineError):
    """A request the built artifact cannot serve (e.g. a prompt longer than kv_max allows)."""


class BuildError(PipelineError):
    """Tracing or compiling a rank failed."""


class IntegrityError(PipelineError):
    """A checksum, signature, manifest or archive check failed. Nothing was loaded."""


class ParityError(PipelineError):
    """The artifact's outputs do not match the float reference."""


class ThroughputError(PipelineError):
    """A throughput gate failed."""


class PreflightError(PipelineError):
    """The host lacks the memory, swap, disk or devices the stage needs."""


class PublishError(PipelineError):
    """Publishing was refused or failed. The local artifacts are untouched."""


class DiskFullError(PipelineError):
    """A write ran out of space (or hit the file size limit). Nothing was kept under its final name."""


class StaleInputError(PipelineError):
    """A stage's input record no longer matches what it was made from (other weights, prompts, configuration or
    backend): the message names the stage to run again."""


@dataclass(frozen=True)
class ErrorRecord:
    """What a child process writes about an error so that its parent can raise it again."""

    error_type: str
    error: str
    problems: tuple[str, ...] | None = None
    """A ConfigError's."""

    @classmethod
    def of(cls, exc: BaseException) -> ErrorRecord:
        return cls(type(exc).__name__, str(exc), tuple(exc.problems) if isinstance(exc, ConfigError) else None)

    def raised_again(self) -> PipelineError | None:
        """The error, as the same class with the same message; None when it was not one of the classes above (a
        bug or a crash: the caller says the work could not run)."""
        cls = _CLASSES.get(self.error_type)
        if cls is None:
            return None
        if cls is ConfigError:
            return ConfigError(list(self.problems or [self.error]))
        return cls(self.error)


_CLASSES = {cls.__name__: cls for cls in (PipelineError, *PipelineError.__subclasses__())}
