"""Fingerprints: key order never matters, values always do; the code digest ignores comments and formatting."""

from __future__ import annotations

from pipeline import records
from pipeline.records import code_digest, fingerprint


def test_fingerprint_ignores_key_order_and_sees_values():
    assert fingerprint({"a": 1, "b": {"c": [1, 2]}}) == fingerprint({"b": {"c": [1, 2]}, "a": 1})
    assert fingerprint({"a": 1}) != fingerprint({"a": 2})
    assert fingerprint({"a": [1, 2]}) != fingerprint({"a": [2, 1]})


def test_code_digest_is_semantic(tmp_path, monkeypatch):
    monkeypatch.setattr(records, "PACKAGE_DIR", tmp_path)
    src = tmp_path / "m.py"
    src.write_text('def f(x):\n    """Doc."""\n    return x + 1\n')
    base = code_digest("m.py")
    src.write_text('# a comment\ndef f( x ):\n    """Another doc."""\n\n    return x+1  # why\n')
    assert code_digest("m.py") == base
    src.write_text('def f(x):\n    return x + 2\n')
    assert code_digest("m.py") != base
