"""Choice lists as string enums: a setting's allowed values written once, and compared, logged and serialised as
the plain strings they are.

``StrEnum`` is ``enum.StrEnum`` on Python 3.11+, and the same behaviour spelled out on 3.10 (which the pipeline
supports, and which the Neuron SDK's Ubuntu 22.04 hosts run): members are ``str`` instances whose ``str()``,
``format()`` and JSON form are their value, so records and fingerprints hold the plain string. OmegaConf validates
an Enum-typed config field by member *name*, so every member is named as its value.
"""

from __future__ import annotations

import sys
from enum import Enum

if sys.version_info >= (3, 11):
    from enum import StrEnum
else:
    class StrEnum(str, Enum):
        """``enum.StrEnum`` of Python 3.11, for 3.10."""

        def __str__(self) -> str:
            return str.__str__(self)


def values(choices: type[Enum]) -> list[str]:
    """The allowed values of ``choices``, in their order, as a message lists them."""
    return [member.value for member in choices]
