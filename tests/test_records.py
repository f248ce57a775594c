"""Fingerprints: key order never matters, values always do; the code digest ignores comments and formatting. The
typed records (model.json, build.json, the manifest) read back to exactly the JSON on disk, and a record this release
cannot read is refused naming the file, the key and the fix, or rebuilt where a stage would have trusted it."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from pipeline.artifact.manifest import Manifest
from pipeline.core import records
from pipeline.core.build_records import BuildRecord, ModelRecord, ToolchainRecord
from pipeline.core.errors import IntegrityError, PipelineError
from pipeline.core.records import code_digest, fingerprint
from pipeline.paths import Paths

from .helpers import CONF, config, run


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


def test_every_stages_code_is_read_from_the_installed_package():
    """The code tables name paths under pipeline/ (the real one, not a test's copy): each stage's digest covers real
    source, and a path that names nothing is refused rather than hashed as nothing (after the package moved into
    layers, PACKAGE_DIR pointed at pipeline/core and every stage's code hashed as empty: no edit rebuilt anything)."""
    import hashlib

    from pipeline import stages
    from pipeline.backends.registry import BACKENDS
    from pipeline.core.versions import PYPROJECT

    assert records.PACKAGE_DIR == Path(stages.__file__).resolve().parents[1]
    empty = hashlib.sha256().hexdigest()
    for stage in stages.CODE:
        assert stages.code_of(stage) != empty, stage
    assert all((records.PACKAGE_DIR / rel).exists() for rels in [*stages.CODE.values(),
                                                                        *(e.build_code for e in BACKENDS.values())]
               for rel in rels)
    assert PYPROJECT.is_file()
    with pytest.raises(FileNotFoundError, match="no Python source"):
        code_digest("no_such_module.py")


def test_every_backend_has_its_build_code_packages_factors_and_implementation():
    """The backend names are config.Backend's, which conf/backend/ declares (the schema stays torch-free: it does not
    read the registry); the registry has exactly those names, and each name loads a backend of that name."""
    from pipeline.backends import get_backend
    from pipeline.backends.registry import BACKENDS
    from pipeline.config import Backend
    from pipeline.core.choices import values

    names = set(values(Backend))
    assert set(BACKENDS) == names
    assert {f.stem for f in (CONF / "backend").glob("*.yaml")} == names | {"auto"}
    assert all(entry.name == name for name, entry in BACKENDS.items())
    assert {get_backend(name).name for name in names} == names


def test_a_change_to_the_model_stages_code_checks_the_same_checkpoint_again_without_fetching_it(tmp_path,
                                                                                                 monkeypatch):
    """The model stage's code is in its fingerprint (pipeline.stages.CODE), but a code change must not fetch a 16 GB
    checkpoint again: the files on disk, still exactly what was recorded, are checked and recorded again."""
    from pipeline.stages import model as model_stage

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


# -- typed records ----------------------------------------------------------------------------------------------------

RECORDS = [(ToolchainRecord, "toolchain"), (ModelRecord, "model_record"), (BuildRecord, "build_record"),
           (Manifest, "manifest")]
# The keys each stage wrote before the records were typed: published manifests and existing builds have exactly these.
KEYS = {
    ToolchainRecord: {"schema_version", "backend", "packages", "neuronx_cc", "system_packages"},
    ModelRecord: {"fingerprint", "source_fingerprint", "name", "source", "hub_id", "revision", "text_prefix",
                  "head_key", "config_digest", "weights_digest", "files", "spec"},
    BuildRecord: {"fingerprint", "inputs_digest", "variant", "backend", "layout", "compiler", "toolchain", "preflight",
                  "trace", "members", "model"},
    Manifest: {"schema_version", "version", "fingerprint", "model", "variant", "backend", "compiler", "toolchain",
               "layout", "members", "archive", "created_by"},
}


@pytest.fixture(scope="module")
def packaged(tmp_path_factory) -> Path:
    """One variant of the tiny model, built and packaged (its three records written by their stages)."""
    root = tmp_path_factory.mktemp("records") / "artifacts"
    cfg = config(root)
    for stage in ("toolchain", "model", "trace", "package"):
        run(cfg, stage)
    return root


def copy_of(packaged: Path, dst: Path) -> Path:
    shutil.copytree(packaged, dst, ignore=shutil.ignore_patterns("logs"))
    return dst


def edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(("cls", "where"), RECORDS)
def test_a_record_reads_back_to_its_json_and_writes_the_same_bytes(packaged, tmp_path, cls, where):
    """What a stage wrote is what the record holds, key for key (fingerprints hash it: validate hashes the whole
    manifest), and writing it again gives the same bytes: a published manifest survives pull's rewrite."""
    path = getattr(Paths.of(config(packaged)), where)
    record = cls.read(path)
    assert set(json.loads(path.read_text())) == KEYS[cls]
    assert record.to_json() == json.loads(path.read_text())
    record.write(tmp_path / "again.json")
    assert (tmp_path / "again.json").read_bytes() == path.read_bytes()
    assert cls.read(tmp_path / "again.json") == record


def test_a_manifest_published_before_the_records_were_typed_reads_and_writes_back_byte_for_byte(tmp_path):
    """A published manifest as publish wrote it (validation summary and signature, no regression): pull reads it
    and writes it beside the rank directory, and generate reads that copy."""
    published = {
        "schema_version": 1, "version": "512_bf16-ncc2.23.6484.0-1f0c9a7e", "fingerprint": "a" * 64,
        "model": {"name": "gemma4_e4b", "hub_id": "google/gemma-4-E4B-it", "revision": "0" * 40,
                  "config_digest": "b" * 64, "weights_digest": "c" * 64},
        "variant": {"name": "512_bf16", "kv_max": 512, "bucket": 128, "dtype": "bf16", "prefill": "device",
                    "tp_degree": 2},
        "backend": "neuron",
        "compiler": {"id": "ncc2.23.6484.0", "args": ["--auto-cast=none", "-O1"],
                     "versions": {"torch": "2.8.0", "neuronx-cc": "2.23.6484.0+f702b353", "libneuronxla": None}},
        "toolchain": {"schema_version": 2, "backend": "neuron",
                      "packages": {"torch": {"version": "2.8.0"}, "neuronx-cc": {"version": "2.23.6484.0"},
                                   "libneuronxla": {"version": None}},
                      "neuronx_cc": {"version": "2.23.6484.0+f702b353", "source": "neuronxcc.__version__"},
                      "system_packages": {"aws-neuronx-runtime-lib": "2.30.51.0-faa6f4a8a"}},
        "layout": "nxd_model", "members": [{"path": "model.pt", "size": 123456, "sha256": "d" * 64}],
        "archive": {"name": "gemma4_e4b-512_bf16.tar.zst", "format": "tar.zst", "size": 100000, "sha256": "e" * 64,
                    "root": "gemma4_e4b-512_bf16-ncc2.23.6484.0-1f0c9a7e"},
        "created_by": "gemma4-neuron-pipeline 0.1.0",
        "validation": {"parity": {"mode": "logits", "passed": True, "prompts": 2, "prompts_matched": 2,
                                  "teacher_forced_match": 0.9712, "max_abs_dlogit": 0.5},
                       "throughput": {"tokens_per_s": 36.5, "ttft_ms": 120}, "backend": "neuron",
                       "hardware": "inf2_8xlarge", "throughput_floor": None},
        "signature": {"file": "manifest.sig"},
    }
    path = tmp_path / "manifest.json"
    path.write_text(json.dumps(published, indent=2, sort_keys=True) + "\n")  # publish's dump
    manifest = Manifest.read(path)
    assert manifest.shape.tp_degree == 2 and manifest.regression is None and manifest.compiler.args[1] == "-O1"
    manifest.write(tmp_path / "beside.json")
    assert (tmp_path / "beside.json").read_bytes() == path.read_bytes()


def test_the_build_record_and_the_manifest_give_the_variants_shape(packaged):
    cfg = config(packaged)
    paths = Paths.of(cfg)
    build, manifest = BuildRecord.read(paths.build_record), Manifest.read(paths.manifest)
    assert build.shape == manifest.shape == cfg.variant.shape
    assert manifest.members == build.members and manifest.model == ModelRecord.read(paths.model_record).identity


def _drop(key):
    return lambda data: data.pop(key)


@pytest.mark.parametrize(("cls", "where", "edit", "problem"), [
    (BuildRecord, "build_record", _drop("inputs_digest"), r"missing field inputs_digest"),
    (BuildRecord, "build_record", lambda d: d["variant"].update(tp_degree="2"),
     r"field variant\.tp_degree has the wrong type \(str; expected int\)"),
    (BuildRecord, "build_record", lambda d: d["members"][0].update(size=True),
     r"field members\[0\]\.size has the wrong type \(bool; expected int\)"),
    (ModelRecord, "model_record", lambda d: d.update(weights="all of them"), r"unknown field weights"),
    (ModelRecord, "model_record", lambda d: d["files"]["config.json"].pop("sha256"),
     r"missing field files\.config\.json\.sha256"),
    (Manifest, "manifest", lambda d: d.update(schema_version=2), r"schema_version 2 is not 1"),
    (Manifest, "manifest", lambda d: d.update(signature="yes"), r"signature must be an object, not str"),
    (Manifest, "manifest", lambda d: d["toolchain"]["packages"]["torch"].update(version=2.8),
     r"field toolchain\.packages\.torch\.version has the wrong type \(float; expected str\)"),
    (BuildRecord, "build_record", lambda d: d["toolchain"].pop("neuronx_cc"), r"missing field toolchain\.neuronx_cc"),
    (BuildRecord, "build_record", lambda d: d["preflight"]["measured"].pop("written_bytes"),
     r"missing field preflight\.measured\.written_bytes"),
    (BuildRecord, "build_record", lambda d: d["preflight"]["host"].update(neuron_cores="2"),
     r"field preflight\.host\.neuron_cores has the wrong type \(str; expected int\)"),
])
def test_a_reader_refuses_a_broken_record_naming_the_file_the_key_and_the_fix(packaged, tmp_path, cls, where, edit,
                                                                              problem):
    path = getattr(Paths.of(config(packaged)), where)
    broken = tmp_path / path.name
    shutil.copy(path, broken)
    edit_json(broken, edit)
    error = IntegrityError if cls is Manifest else PipelineError
    fix = {ModelRecord: "run stage=model force=true", BuildRecord: "rebuild with stage=trace force=true",
           Manifest: "made again by stage=package force=true"}[cls]
    with pytest.raises(error, match=rf"(?s){broken} is not a valid {cls.KIND}:\n  - {problem}.*{fix}"):
        cls.read(broken)


def test_a_stage_reading_a_broken_record_says_which_stage_to_run_again(packaged, tmp_path):
    cfg = config(copy_of(packaged, tmp_path / "artifacts"), "force=true")
    paths = Paths.of(cfg)
    edit_json(paths.build_record, _drop("model"))
    with pytest.raises(PipelineError, match=rf"(?s){paths.build_record} is not a valid build record:\n"
                                            r"  - missing field model\n.*rebuild with stage=trace force=true"):
        run(cfg, "package")
    paths.model_record.unlink()
    with pytest.raises(PipelineError, match=rf"no model record at {paths.model_record}: run stage=model first"):
        run(cfg, "trace")


def test_a_build_record_this_release_cannot_read_is_rebuilt_not_trusted(packaged, tmp_path):
    """Its fingerprint still matches and its rank files are there: only reading it whole shows it is not this
    release's record, and the trace runs again instead of handing package a record it would refuse."""
    cfg = config(copy_of(packaged, tmp_path / "artifacts"))
    paths = Paths.of(cfg)
    assert run(cfg, "trace")[0].status == "skipped"
    edit_json(paths.build_record, _drop("inputs_digest"))
    assert run(cfg, "trace")[0].status == "ran"
    assert BuildRecord.read(paths.build_record).inputs_digest
    assert run(cfg, "package")[0].status == "skipped"  # the same rank files: the package is still up to date


def test_a_record_the_reader_would_refuse_is_never_written(tmp_path, packaged):
    from dataclasses import replace

    build = BuildRecord.read(Paths.of(config(packaged)).build_record)
    with pytest.raises(PipelineError, match=r"not written\) is not a valid build record:\n  - field backend has the "
                                            r"wrong type \(NoneType; expected str\)"):
        replace(build, backend=None).write(tmp_path / "build.json")
    assert not (tmp_path / "build.json").exists()


def test_a_trace_result_is_one_object_in_build_json_and_keeps_its_typed_fields_its_own():
    """build.json's ``trace`` is what it was before the trace was typed: the files, layout and peak RSS beside the
    backend's own keys, in one object; a backend's details may not shadow a typed field."""
    from pipeline.core.build_records import Member, TraceResult

    members = (Member("tp_0.pt", 10, "a" * 64), Member("tp_1.pt", 11, "b" * 64))
    traced = TraceResult(members, "per_rank", 123, {"compiler": "torch.jit.trace", "wall_s": 1.5})
    assert traced.to_json() == {
        "members": [{"path": "tp_0.pt", "size": 10, "sha256": "a" * 64},
                    {"path": "tp_1.pt", "size": 11, "sha256": "b" * 64}],
        "layout": "per_rank", "peak_rss_bytes": 123, "compiler": "torch.jit.trace", "wall_s": 1.5}
    with pytest.raises(ValueError, match=r"repeat the typed fields \['layout'\]"):
        TraceResult(members, "per_rank", 123, {"layout": "nxd_model"}).to_json()


def test_a_variants_fields_are_declared_once_by_the_build_shape():
    """``BuildShape`` (core/shape.py) declares the fields that decide what is traced, with their types; the config
    schema's ``VariantConfig`` and the build record's ``Variant`` are build shapes with a name, declaring no shape field
    again (the schema only gives tp_degree its default): a field added to the shape is in both, typed alike."""
    import typing
    from dataclasses import fields

    from pipeline.config import VariantConfig
    from pipeline.core.build_records import Variant
    from pipeline.core.shape import BuildShape

    shape = typing.get_type_hints(BuildShape)
    for cls, redeclared in ((VariantConfig, {"tp_degree"}), (Variant, set())):
        assert issubclass(cls, BuildShape)
        assert set(cls.__dict__["__annotations__"]) == {"name"} | redeclared, cls
        hints = typing.get_type_hints(cls)
        assert {name: hints[name] for name in shape} == shape
        assert [f.name for f in fields(cls)] == [*shape, "name"]


# Where a record keeps JSON it does not type, and why: nothing else may (issue 43).
UNTYPED = {
    "Manifest.validation": "the summary as the release that published it wrote it: pull reads any release's manifest "
                           "(ValidationSummary reads it strictly where it is compared, Headline leniently for show)",
    "BuildRecord.trace": "the backend's own account of its trace, whose schema is the backend's: a new backend "
                         "brings its own without an edit here, and nothing is decided from it",
}


def _parts(hint) -> list:
    """``hint`` and every type inside it, however deep (``tuple[dict[str, X], ...]``: tuple, dict, str, X)."""
    import typing

    return [hint, *[part for arg in typing.get_args(hint) for part in _parts(arg)]]


def _fields_of(cls, seen: set) -> list[tuple[str, object]]:
    """Every field of the record ``cls`` and of the dataclasses it holds, as ``Class.field`` with its annotation."""
    import dataclasses
    import typing

    if cls in seen or not dataclasses.is_dataclass(cls):
        return []
    seen.add(cls)
    found = []
    for name, hint in typing.get_type_hints(cls).items():
        if name not in {f.name for f in dataclasses.fields(cls)}:
            continue
        found.append((f"{cls.__name__}.{name}", hint))
        for part in _parts(hint):
            found += _fields_of(part, seen)
    return found


def test_every_record_field_is_typed_but_the_two_kept_as_written():
    """No record holds ``Any``, ``object`` or an unparameterised dict or list but the fields ``UNTYPED`` names; a
    dict keyed by data (a path, a package, a context) holds typed values."""
    import importlib
    import typing

    package = Path(records.__file__).parents[1]
    for path in package.rglob("*.py"):  # every module declaring a record, found rather than listed
        if re.search(r"^class \w+\(Record\)", path.read_text(), re.M):
            importlib.import_module(".".join(path.relative_to(package.parent).with_suffix("").parts))
    seen: set = set()
    loose = [f"{where}: {hint}" for cls in _records(records.Record) for where, hint in _fields_of(cls, seen)
             if any(part in (typing.Any, object, dict, list, tuple) for part in _parts(hint))
             and where not in UNTYPED]
    assert not loose, "\n".join(loose)


def _records(base) -> list:
    return [c for sub in base.__subclasses__() for c in (sub, *_records(sub))]


def test_a_regression_row_holds_a_verdict_or_a_figure_and_nothing_else():
    """A row compares a verdict, a count or a figure (``bool | float``): each reads back as itself, a string is
    refused naming the row's key."""
    from pipeline.artifact.manifest import RegressionCheck, RegressionResult

    from .helpers import a_manifest

    rows = (RegressionCheck("parity passed", True, False, None, "must pass", False),
            RegressionCheck("prompts matched", 3, 3, 0.0, ">= previous", True),
            RegressionCheck("decode tokens/s", 36.5, 30.1, -0.1753, ">= 34.675", False))
    manifest = a_manifest(regression=RegressionResult("v0", "f" * 64, True, rows, False, True))
    again = Manifest.from_json(json.loads(json.dumps(manifest.to_json())), "a manifest")
    assert again.regression.checks == rows and [type(r.previous) for r in again.regression.checks] == [bool, int, float]
    broken = manifest.to_json()
    broken["regression"]["checks"][2]["current"] = "30.1"
    with pytest.raises(IntegrityError, match=r"field regression\.checks\[2\]\.current has the wrong type \(str; "
                                             r"expected bool or float\)"):
        Manifest.from_json(broken, "a manifest")
