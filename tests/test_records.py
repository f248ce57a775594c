"""Fingerprints: key order never matters, values always do; the code digest ignores comments and formatting."""

from __future__ import annotations

import json

from pipeline.core import records
from pipeline.core.records import code_digest, fingerprint


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


def test_a_change_to_the_model_stages_code_checks_the_same_checkpoint_again_without_fetching_it(tmp_path,
                                                                                                 monkeypatch):
    """The model stage's code is in its fingerprint (pipeline.stages.CODE), but a code change must not fetch a 16 GB
    checkpoint again: the files on disk, still exactly what was recorded, are checked and recorded again."""
    from pipeline.stages import model as model_stage

    from .helpers import config, run

    cfg = config(tmp_path, variant=None)
    run(cfg, "model")
    before = json.loads((tmp_path / cfg.model.name / "model.json").read_text())
    fetched, real = [], model_stage.materialise
    monkeypatch.setattr(model_stage, "materialise", lambda cfg, into: (fetched.append(into), real(cfg, into)))
    monkeypatch.setattr(model_stage, "code_of", lambda stage: "edited")
    assert run(cfg, "model")[0].status == "ran"
    after = json.loads((tmp_path / cfg.model.name / "model.json").read_text())
    assert fetched == [] and after["fingerprint"] != before["fingerprint"]
    assert after["weights_digest"] == before["weights_digest"]

    (tmp_path / cfg.model.name / "weights" / "config.json").write_text("{}")  # the files no longer what was recorded
    monkeypatch.setattr(model_stage, "code_of", lambda stage: "edited again")
    run(cfg, "model")
    assert len(fetched) == 1
    again = json.loads((tmp_path / cfg.model.name / "model.json").read_text())
    assert again["weights_digest"] == before["weights_digest"]
