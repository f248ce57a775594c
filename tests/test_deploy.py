"""The scheduled-rebuild files users adopt as is: deploy/rebuild.sh's decisions (with stand-in `python` and `dvc`
commands that record their calls), and the GitHub Actions workflow and systemd units parse and point at it."""

from __future__ import annotations

import configparser
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
REBUILD = ROOT / "deploy" / "rebuild.sh"

STUB = """#!/bin/sh
echo "{name} $*" >> "$CALLS"
case "{name} $*" in
    "python -m pipeline check-upgrades --apply"*) exit "${{APPLY_STATUS:-0}}" ;;
    "python -m pipeline check-upgrades"*) exit "${{CHECK_STATUS:-0}}" ;;
    "dvc repro"*) exit "${{REPRO_STATUS:-0}}" ;;
    "dvc pull"*) exit "${{PULL_STATUS:-0}}" ;;
    "python -m pipeline check-remote"*) exit "${{REMOTE_STATUS:-0}}" ;;
esac
exit 0
"""


PULL = ["python -m pipeline check-remote", "dvc pull --allow-missing"]
REFRESH = "python -m pipeline refresh-index"  # the signed index written again before it expires, after any build


def rebuild(tmp_path: Path, **env: str) -> tuple[int, list[str], str]:
    """Run deploy/rebuild.sh in an empty checkout stand-in; return its status, the commands it ran and stderr."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in ("python", "dvc"):
        (bin_dir / name).write_text(STUB.format(name=name))
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls"
    calls.unlink(missing_ok=True)
    (tmp_path / "repo").mkdir(exist_ok=True)
    full_env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls), "REPO_DIR": str(tmp_path / "repo"),
                **env}
    done = subprocess.run(["sh", str(REBUILD)], env=full_env, capture_output=True, text=True, timeout=60)
    ran = calls.read_text().splitlines() if calls.exists() else []
    return done.returncode, ran, done.stderr


def test_the_rebuild_script_is_valid_shell():
    subprocess.run(["sh", "-n", str(REBUILD)], check=True)
    assert os.access(REBUILD, os.X_OK)


def test_up_to_date_rebuilds_only_what_changed_and_pushes(tmp_path):
    status, ran, _ = rebuild(tmp_path, CHECK_STATUS="0")
    assert status == 0
    assert ran == [*PULL, "python -m pipeline check-upgrades", "dvc repro", REFRESH, "dvc push"]


def test_an_upgrade_is_applied_then_pushed(tmp_path):
    status, ran, _ = rebuild(tmp_path, CHECK_STATUS="3", CHECK_ARGS="--neuron-index https://example.invalid/simple")
    assert status == 0
    assert ran == [*PULL,
                   "python -m pipeline check-upgrades --neuron-index https://example.invalid/simple",
                   "python -m pipeline check-upgrades --apply --neuron-index https://example.invalid/simple",
                   REFRESH, "dvc push"]


def test_check_only_reports_an_upgrade_and_builds_nothing(tmp_path):
    status, ran, err = rebuild(tmp_path, CHECK_STATUS="3", UPGRADE="check")
    assert status == 3
    assert ran == [*PULL, "python -m pipeline check-upgrades"]
    assert "not applied" in err


@pytest.mark.parametrize("env, expected_status, last_call", [
    ({"CHECK_STATUS": "1"}, 1, "python -m pipeline check-upgrades"),
    ({"CHECK_STATUS": "4"}, 4, "python -m pipeline check-upgrades"),
    ({"CHECK_STATUS": "0", "REPRO_STATUS": "4"}, 4, "dvc repro"),
    ({"CHECK_STATUS": "3", "APPLY_STATUS": "1"}, 1, "python -m pipeline check-upgrades --apply"),
])
def test_a_failed_step_stops_before_the_push(tmp_path, env, expected_status, last_call):
    status, ran, _ = rebuild(tmp_path, **env)
    assert status == expected_status
    assert ran[-1] == last_call
    assert "dvc push" not in ran


@pytest.mark.parametrize("env, last_call", [
    ({"REMOTE_STATUS": "1"}, "python -m pipeline check-remote"),  # no bucket, refused credentials: nothing built
    ({"PULL_STATUS": "1"}, "dvc pull --allow-missing"),  # --allow-missing lets an empty remote pass; not this
])
def test_a_remote_that_cannot_be_used_stops_before_any_build_work(tmp_path, env, last_call):
    status, ran, _ = rebuild(tmp_path, **env)
    assert status == 1 and ran[-1] == last_call
    assert not any(call.startswith(("dvc repro", "python -m pipeline check-upgrades")) for call in ran)


def test_without_a_remote_and_with_a_bad_setting(tmp_path):
    status, ran, _ = rebuild(tmp_path, SKIP_DVC_REMOTE="1", REPRO_ARGS="--force")
    assert status == 0 and ran == ["python -m pipeline check-upgrades", "dvc repro --force", REFRESH]
    status, ran, err = rebuild(tmp_path, UPGRADE="yes")
    assert status == 2 and ran == []
    assert "UPGRADE=yes" in err and "UPGRADE=apply" in err


def test_the_workflow_runs_the_script_on_a_schedule_on_an_inf2_runner():
    workflow = yaml.safe_load((ROOT / ".github" / "workflows" / "rebuild.yml").read_text())
    triggers = workflow[True]  # YAML 1.1 reads the key `on` as a boolean
    assert triggers["schedule"][0]["cron"].count(" ") == 4
    assert set(triggers["workflow_dispatch"]["inputs"]["upgrade"]["options"]) == {"apply", "check"}
    assert workflow["concurrency"]["cancel-in-progress"] is False
    job = workflow["jobs"]["rebuild"]
    assert "inf2" in job["runs-on"] and "self-hosted" in job["runs-on"]
    runs = [step.get("run", "") for step in job["steps"]]
    assert "deploy/rebuild.sh" in runs
    checkout = next(step for step in job["steps"] if str(step.get("uses", "")).startswith("actions/checkout"))
    assert checkout["with"]["clean"] is False  # keeps .venv, artifacts/ and the DVC cache


def test_the_systemd_units_run_the_script_daily():
    def unit(name):
        parser = configparser.ConfigParser(strict=False, interpolation=None)
        parser.optionxform = str
        parser.read(ROOT / "deploy" / "systemd" / name)
        return parser

    service, timer = unit("gemma4-rebuild.service"), unit("gemma4-rebuild.timer")
    assert service["Service"]["Type"] == "oneshot"
    assert service["Service"]["ExecStart"].endswith("deploy/rebuild.sh")
    assert service["Service"]["ExecStart"].startswith(service["Service"]["WorkingDirectory"])
    assert timer["Timer"]["Persistent"] == "true"
    assert timer["Install"]["WantedBy"] == "timers.target"
    if shutil.which("systemd-analyze"):
        done = subprocess.run(["systemd-analyze", "calendar", timer["Timer"]["OnCalendar"]], capture_output=True)
        assert done.returncode == 0 and b"Next elapse" in done.stdout
