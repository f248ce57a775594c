"""The command line refuses bad input before any work, naming the setting and the fix, and touches nothing."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def existing_artifacts(tmp_path) -> Path:
    root = tmp_path / "artifacts"
    (root / "gemma4_tiny" / "512_bf16" / "build").mkdir(parents=True)
    (root / "gemma4_tiny" / "512_bf16" / "build" / "tp_0.pt").write_bytes(b"an earlier build")
    return root


@pytest.mark.parametrize(("args", "expected"), [
    (["+variant=nope"], "variant=nope is not one of ['2048_bf16', '2048_bf16_bs4', '2048_bf16_host'"),
    ([], "add +variant=NAME (one of 2048_bf16, 2048_bf16_bs4, 2048_bf16_host, 2048_bf16_host_bs4, 2048_fp32, "
         "256_bf16_host, 512_bf16, 512_bf16_host, 512_bf16_tp1, 512_fp32)"),
    (["stage=trace"], "stage 'trace' builds one variant: add +variant=NAME"),
    (["+variant=512_bf16", "validate.max_new_tokns=3"], "did you mean 'validate.max_new_tokens'?"),
    (["+variant=512_bf16", "variant.kv_max=lots"], "variant.kv_max: Value 'lots' of type 'str' could not be converted"),
    (["+variant=512_bf16", "variant.dtype=int8"], "variant.dtype='int8' is not one of ['bf16', 'fp32']"),
    (["+variant=512_bf16", "variant.tp_degree=0"], "variant.tp_degree=0 must be at least 1"),
    # refused before any stage (it ran the toolchain, model and reference stages first, a minute on the tiny model)
    (["+variant=512_bf16", "variant.kv_max=99968"], "variant.kv_max=99968 is beyond the model's 4096 positions"),
    # the override is named, not the file (which does not set it)
    (["+variant=512_bf16", "variant.name=mybuild"], "variant.name='mybuild': a variant's name is its file's"),
])
def test_bad_input_is_refused_before_any_work(existing_artifacts, args, expected):
    before = snapshot(existing_artifacts)
    proc = cli(*args, f"artifacts_dir={existing_artifacts}", "hydra.run.dir=" + str(existing_artifacts.parent / "log"))
    assert proc.returncode != 0
    assert expected in proc.stdout + proc.stderr
    after = snapshot(existing_artifacts)
    assert after == before  # nothing built, nothing removed, nothing overwritten


def test_unknown_variant_lists_the_available_ones(tmp_path):
    proc = cli("+variant=nope", f"artifacts_dir={tmp_path}")
    out = proc.stdout + proc.stderr
    for name in ("256_bf16_host", "512_fp32", "2048_bf16"):
        assert name in out


def test_ctrl_c_says_one_line_and_exits_130(tmp_path):
    """Interrupted in the middle of a stage: one line saying so, no tracebacks, the shell's 130."""
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "pipeline", "+variant=512_fp32", "backend=cpu",
                             f"artifacts_dir={tmp_path / 'artifacts'}"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,  # the log is on stderr
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as a terminal gives it
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if "trace: 512_fp32 on cpu" in line:
            proc.send_signal(signal.SIGINT)
            break
    rest = proc.stdout.read()
    proc.wait(timeout=60)
    assert proc.returncode == 130, "".join(seen) + rest
    assert "interrupted: nothing half-written was kept" in rest and "Traceback" not in rest
    assert not (tmp_path / "artifacts" / "gemma4_tiny" / "512_fp32" / "build").exists()


def test_help_lists_the_subcommands_and_common_overrides_before_hydras_groups():
    from pipeline.__main__ import SUBCOMMANDS
    from pipeline.stages import ORDER

    shown = cli("--help")
    assert shown.returncode == 0, shown.stderr
    ours, hydras = shown.stdout.split("== Configuration groups ==")
    assert all(f"  {name} " in ours for name in SUBCOMMANDS) and ", ".join(ORDER) in ours
    assert "+variant=NAME" in ours
    assert "variant: " in hydras and "512_bf16" in hydras
    # the groups, not every key of the configuration (about 200 lines with Hydra's template): --cfg job shows those
    assert len(shown.stdout.splitlines()) < 60 and "--cfg job +variant=" in hydras
    assert "trace_per_graph_gb" not in hydras


LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (DEBUG|INFO|WARNING|ERROR|CRITICAL) ([\w.]+): (.*)")


def test_the_build_and_a_subcommand_log_in_one_format(tmp_path):
    """Hydra sets up the build's logging (conf/hydra/job_logging/), each subcommand its own: the lines look alike,
    on standard error, and standard output is left to results."""
    build = cli("+variant=512_fp32", "stage=validate", "backend=cpu", f"artifacts_dir={tmp_path / 'artifacts'}",
                f"hydra.run.dir={tmp_path / 'log'}")
    schedule = cli("schedule", "--dry-run", "--variants", "512_fp32", "backend=cpu",
                   f"artifacts_dir={tmp_path / 'artifacts'}")
    assert build.returncode == 1 and schedule.returncode == 0, build.stderr + schedule.stderr
    assert build.stdout == schedule.stdout == ""
    build_lines = [LINE.fullmatch(line) for line in build.stderr.splitlines()]
    schedule_lines = [LINE.fullmatch(line) for line in schedule.stderr.splitlines()]
    assert build_lines and schedule_lines and all(build_lines + schedule_lines), build.stderr + schedule.stderr
    assert [m.groups()[:2] for m in build_lines] == [("ERROR", "pipeline")]
    assert build_lines[0][3].endswith("dist/manifest.json: run the package stage first")
    assert {m.groups()[:2] for m in schedule_lines} == {("INFO", "pipeline")}
    assert schedule_lines[0][3].startswith("schedule: 1 variants on cpu; budget ")


def test_a_misspelt_subcommand_is_named_with_the_nearest_one():
    wrong = cli("pul", "x")
    assert wrong.returncode == 2 and wrong.stdout == ""
    assert "'pul' is not a subcommand: did you mean 'pull'?" in wrong.stderr
    assert "missing EQUAL" not in wrong.stderr and "Traceback" not in wrong.stderr


@pytest.mark.parametrize(("override", "expected"), [
    ("validate.max_new_tokenz=3", "unknown key 'validate.max_new_tokenz': did you mean 'validate.max_new_tokens'?"),
    ("+validate.max_new_tokenz=3", "unknown key 'validate.max_new_tokenz': did you mean 'validate.max_new_tokens'?"),
    ("valdate.max_new_tokens=3", "unknown key 'valdate.max_new_tokens': did you mean 'validate.max_new_tokens'?"),
    ("backnd=cpu", "unknown key 'backnd': did you mean 'backend'?"),
    ("~model.pth", "unknown key 'model.pth': did you mean 'model.path'?"),
])
def test_a_misspelt_key_is_named_with_the_nearest_one_before_hydra_starts(tmp_path, override, expected):
    """One line and exit 2, as for a misspelt subcommand: not Hydra's advice to add the key with '+', and no run
    directory made."""
    proc = cli("+variant=512_bf16", override, f"artifacts_dir={tmp_path / 'artifacts'}",
               f"hydra.run.dir={tmp_path / 'log'}")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"python -m pipeline: {expected}\n"
    assert list(tmp_path.iterdir()) == []


def test_a_key_misspelt_in_a_conf_file_is_named_with_the_nearest_one(tmp_path):
    """A conf file of one's own (on Hydra's search path) with a misspelt key: refused by the schema, before any
    stage, naming the key and the nearest real one."""
    (tmp_path / "conf" / "validate").mkdir(parents=True)
    validate = (REPO / "conf" / "validate" / "default.yaml").read_text()
    assert "\nmax_new_tokens: " in validate
    (tmp_path / "conf" / "validate" / "mine.yaml").write_text(validate.replace("\nmax_new_tokens: ",
                                                                               "\nmax_new_tokns: "))
    proc = cli("+variant=512_bf16", "validate=mine", f"hydra.searchpath=[file://{tmp_path / 'conf'}]",
               f"artifacts_dir={tmp_path / 'artifacts'}", f"hydra.run.dir={tmp_path / 'log'}")
    out = proc.stdout + proc.stderr  # Hydra's logging goes to stdout
    assert proc.returncode == 1, out
    assert "unknown key 'validate.max_new_tokns': did you mean 'validate.max_new_tokens'?" in out
    assert "Traceback" not in out and not (tmp_path / "artifacts").exists()


def test_the_scheduler_names_a_misspelt_key_too(tmp_path):
    """``schedule`` composes through Hydra's API (pipeline.run.compose), not the command line: the same message."""
    proc = cli("schedule", "--variants", "512_bf16", "validate.max_new_tokenz=3",
               f"artifacts_dir={tmp_path / 'artifacts'}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "unknown key 'validate.max_new_tokenz': did you mean 'validate.max_new_tokens'?" in out
    assert "Traceback" not in out and not (tmp_path / "artifacts").exists()


def test_overrides_of_real_keys_pass_the_misspelling_check():
    """Keys of dicts with free-form keys, group choices, Hydra's own settings and flags are not flagged."""
    from pipeline.run import unknown_override_keys

    assert unknown_override_keys([
        "--multirun", "+variant=glob(*)", "model=gemma4_e4b", "hydra/launcher=inf2_slurm", "hydra.run.dir=x",
        "--cfg", "job", "validate.max_new_tokens=8,16", "model.resources.neuron.disk_gb=200",
        "+validate.throughput.floors.neuron.trn1_2xlarge.tokens_per_s=20", "backend.compiler_args.bf16=[-O1]",
        "validate.prompts.0.max_tokens=30", "~preflight.make_swap", "model.tiny.hidden_size=64", "stage=trace",
    ]) == []


@pytest.mark.parametrize("command", ["versions", "pull"])
def test_a_source_that_is_no_folder_nor_repo_id_is_named_as_such(tmp_path, command):
    """A path that does not exist went to the Hub, whose refusal ("HFValidationError: Repo id must use alphanumeric
    chars") named neither the folder nor the mistake."""
    missing = tmp_path / "published"
    proc = cli(command, str(missing), *(["512_bf16"] if command == "pull" else []))
    assert proc.returncode == 1, proc.stderr
    assert f"{str(missing)!r} is neither a local publish folder (no such folder) nor a Hugging Face repo id" \
        in proc.stderr and "HFValidationError" not in proc.stderr


def test_backend_auto_says_its_choice_once(tmp_path):
    proc = cli("+variant=512_fp32", f"artifacts_dir={tmp_path}", "stage=trace")  # refused later: no toolchain record
    assert (proc.stdout + proc.stderr).count("backend=auto chose") == 1


def test_a_shape_the_validation_prompts_cannot_cover_is_refused_before_the_trace(tmp_path):
    """kv_max 384 with 128-token buckets: no shipped prompt spans two buckets and fits. validate refused it, after the
    trace and the package (on E4B, hours); now the check runs once the reference is there, before the trace."""
    proc = cli("+variant=512_fp32", "variant.kv_max=384", f"artifacts_dir={tmp_path}")
    assert proc.returncode == 1 and "lack one longer than two buckets" in proc.stderr, proc.stderr[-2000:]
    assert "stage reference: ran" in proc.stderr and "trace: preflight" not in proc.stderr
    assert not (tmp_path / "gemma4_tiny" / "512_fp32+kv384").exists()


def test_a_field_set_to_base_keeps_the_files_value_and_variant_folder_is_one_folder_name(tmp_path):
    """What dvc.yaml's sweep stages pass (params.yaml's sweep): `variant.kv_max=base` is the file's own value, and
    the build goes to variant_folder, a plain folder name under the model's."""
    kept = cli("+variant=512_fp32", "variant.kv_max=base", "variant.dtype=base", "stage=toolchain",
               f"artifacts_dir={tmp_path}")
    assert kept.returncode == 0 and "built as" not in kept.stderr, kept.stderr[-2000:]
    swept = cli("+variant=512_fp32", "variant.kv_max=1024", "variant.bucket=base", "variant_folder=sweep-512_fp32",
                "stage=toolchain", f"artifacts_dir={tmp_path}")
    assert swept.returncode == 0 and "built as 512_fp32+kv1024, in variant_folder sweep-512_fp32" in swept.stderr
    outside = cli("+variant=512_fp32", "variant_folder=../elsewhere", "stage=toolchain", f"artifacts_dir={tmp_path}")
    assert outside.returncode == 1 and "variant_folder='../elsewhere' is not a folder name" in outside.stderr


@pytest.mark.parametrize(("sweep", "fixed", "built"), [
    ("+variant=512_bf16,512_fp32", "variant.kv_max=1024", ["512_bf16+kv1024", "512_fp32+kv1024"]),
    ("+variant=glob(512_*)", "variant.dtype=fp32",
     ["512_bf16+fp32", "512_bf16_host+fp32", "512_bf16_tp1+fp32", "512_fp32"]),
])
def test_a_fixed_override_applies_to_every_variant_of_a_multirun(tmp_path, sweep, fixed, built):
    """Hydra refused it ("Could not override 'variant.kv_max'... use +variant.kv_max"): its sweeper composes the
    config without the swept group first."""
    proc = cli("--multirun", sweep, fixed, "stage=toolchain", f"artifacts_dir={tmp_path}")
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said[-2000:]
    assert f"multirun: {len(built)} variant(s), {len(built)} succeeded, 0 failed" in said
    assert all(re.search(rf"^\s+{re.escape(name)}\s+ok", said, re.M) for name in built), said[-2000:]
    assert "its text is meaningless by design" in said  # the tiny model's builds, said where make demo ends


@pytest.mark.parametrize(("args", "said"), [
    (["--multirun", "variant=512_bf16,512_fp32"], "a variant is added to the configuration, not overridden: "
                                                  "write +variant=512_bf16,512_fp32"),
    (["variant=512_bf16"], "write +variant=512_bf16"),
    (["--multirun", "+variant=512_bf16,512_fp32", "variant.kv_mx=1024"], "did you mean 'variant.kv_max'?"),
])
def test_a_missing_plus_or_a_typo_in_a_multirun_is_a_usage_error(tmp_path, args, said):
    proc = cli(*args, "stage=toolchain", f"artifacts_dir={tmp_path}")
    assert proc.returncode == 2 and said in proc.stderr, proc.stderr[-2000:]
    assert "HYDRA_FULL_ERROR" not in proc.stderr


def test_subcommand_help_shows_no_restructuredtext_markup():
    from pipeline.__main__ import SUBCOMMANDS

    for name in SUBCOMMANDS:
        proc = cli(name, "--help")
        assert proc.returncode == 0 and "``" not in proc.stdout, (name, proc.stdout[:500])


@pytest.mark.parametrize(("args", "said"), [
    (["--margin", "2"], "--margin 2.0 --limit None: the margin is a score from 0 to 1"),
    ([], "eval needs lm-eval: pip install -e '.[eval]'"),
])
def test_eval_refuses_bad_input_and_a_missing_lm_eval_before_it_serves_anything(tmp_path, args, said):
    """``python -m pipeline eval`` says what is wrong in one line before it starts a server (make test-loadtools runs
    it for real, in .venv-eval where lm-eval is installed)."""
    import importlib.util

    if importlib.util.find_spec("lm_eval") is not None and not args:
        pytest.skip("lm-eval is installed here")
    proc = cli("eval", str(tmp_path / "nowhere"), "--checkpoint", str(tmp_path), *args)
    assert proc.returncode == 1 and said in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
