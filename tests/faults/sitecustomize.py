"""Fault and audit shims for tests/test_reliability.py, loaded by every Python process (ranks included) started with
this folder on PYTHONPATH. Each acts only when its variable is set; with none set, this file does nothing.

FAULT_SLOW_JIT_SAVE_S=N     after ``torch.jit.save`` writes a file, sleep N seconds: a rank stays in the middle of
                            its work, its file written under the staging name, long enough to be interrupted.
AUDIT_JIT_LOAD=FILE         append ``<sha256> <path>`` to FILE for every ``torch.jit.load`` call, before loading.
"""

import hashlib
import os

if os.environ.get("FAULT_SLOW_JIT_SAVE_S") or os.environ.get("AUDIT_JIT_LOAD"):
    import time

    import torch

    _save, _load = torch.jit.save, torch.jit.load

    def _slow_save(obj, f, *args, **kwargs):
        _save(obj, f, *args, **kwargs)
        time.sleep(float(os.environ["FAULT_SLOW_JIT_SAVE_S"]))

    def _audited_load(f, *args, **kwargs):
        digest = hashlib.sha256(open(f, "rb").read()).hexdigest()
        with open(os.environ["AUDIT_JIT_LOAD"], "a") as log:
            log.write(f"{digest} {os.path.abspath(f)}\n")
        return _load(f, *args, **kwargs)

    if os.environ.get("FAULT_SLOW_JIT_SAVE_S"):
        torch.jit.save = _slow_save
    if os.environ.get("AUDIT_JIT_LOAD"):
        torch.jit.load = _audited_load
