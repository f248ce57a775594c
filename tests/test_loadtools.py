"""The tools users point at an OpenAI endpoint, run against ``serve`` of the tiny build as users run them, each from its
own environment (make test-loadtools builds them and runs these): lm-eval through ``python -m pipeline eval`` (a
log-likelihood task and a generation task, beside lm-eval's transformers backend on the checkpoint), guidellm's default
streamed run and aiperf's streamed chat profile, each with the output length it asks for.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .test_serve import VARIANT, Server

pytestmark = pytest.mark.loadtools

REPO = Path(__file__).resolve().parent.parent


def tool(variable: str) -> str:
    """The executable ``make test-loadtools`` names in ``variable``."""
    path = os.environ.get(variable)
    if not path:
        pytest.skip(f"{variable} is not set: make test-loadtools installs the tool and runs this")
    return path


@pytest.fixture(scope="module")
def published(tiny_512_fp32) -> tuple[Path, Path, str]:
    root, _ = tiny_512_fp32
    version = json.loads((root / "gemma4_tiny" / VARIANT / "publish.json").read_text())["tag"]
    return root / "published", root / "gemma4_tiny" / "weights", version


@pytest.fixture(scope="module")
def server(published, tmp_path_factory):
    srv = Server(published, tmp_path_factory.mktemp("dest"), "--served-model-name", "gemma-4-tiny")
    srv.wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log.read_text()


def test_pipeline_eval_scores_the_served_build_as_its_reference_with_lm_eval(published, tmp_path):
    """lm-eval's local-completions client on both task kinds: the multiple-choice task needs ``echo`` with the
    prompt's log-probabilities and token-id prompts, the generation task stop strings; the tiny build's greedy
    parity with its fp32 reference makes the two scores equal."""
    pytest.importorskip("lm_eval", reason="the [eval] extra: make test-loadtools runs this in .venv-eval")
    folder, weights, version = published
    out = tmp_path / "eval.json"
    run = subprocess.run([sys.executable, "-m", "pipeline", "eval", str(folder), VARIANT, "--checkpoint", str(weights),
                          "--dest", str(tmp_path / "dest"), "--allow-unsigned", "--output", str(out)],
                         cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout + run.stderr[-5000:]
    said = json.loads(out.read_text())
    assert said["version"] == version
    scores = {t["task"]: t for t in said["tasks"]}
    assert set(scores) == {"gemma4_capitals_mc", "gemma4_short_answers"}
    assert all(t["served"] == t["reference"] and t["passed"] for t in said["tasks"]), said
    assert "gemma4_capitals_mc" in run.stdout and "reference" in run.stdout


def test_guidellms_default_streamed_run_completes_every_request_at_its_output_length(server, published, tmp_path):
    """guidellm sends ``stream_options.continuous_usage_stats`` and ``ignore_eos`` with its output length (each a 400
    before): every request succeeds, each with the 8 tokens it asked for."""
    _, weights, _ = published
    out = tmp_path / "guidellm.json"
    run = subprocess.run([tool("GUIDELLM"), "run", "--backend", f"kind=openai_http,target={server.url}",
                          "--profile", "kind=synchronous", "--constraint", "kind=max_requests,count=4",
                          "--data", "kind=synthetic_text,prompt_tokens=16,output_tokens=8",
                          "--tokenizer", f"kind=hf_auto,model={weights}", "--output", f"kind=json,path={out}",
                          "--disable-console-interactive"], capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    metrics = json.loads(out.read_text())["benchmarks"][0]["metrics"]
    assert metrics["request_totals"] == {"successful": 4, "errored": 0, "incomplete": 0, "total": 4}
    output = metrics["output_token_count"]["successful"]
    assert output["min"] == output["max"] == 8, output


def online(env) -> dict:
    """``env`` without the Hub's offline switches (tests/conftest.py sets them): aiperf 0.13 in offline mode looks a
    tokenizer up as a Hub repository only ("Repo id must be in the form 'repo_name'", for a local folder). It is given a
    local folder, so nothing is fetched either way."""
    return {k: v for k, v in env.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}


def test_aiperfs_streamed_chat_profile_gets_the_output_length_it_asks_for(server, published, tmp_path):
    _, weights, _ = published
    art = tmp_path / "aiperf"
    run = subprocess.run([tool("AIPERF"), "profile", "--model", "gemma-4-tiny", "--url", server.url,
                          "--endpoint-type", "chat", "--streaming", "--request-count", "4", "--isl", "16", "--osl", "8",
                          "--tokenizer", str(weights), "--artifact-dir", str(art), "--extra-inputs", "ignore_eos:true",
                          "--use-server-token-count"], capture_output=True, text=True, timeout=600, cwd=tmp_path,
                         env=online(os.environ))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    said = json.loads((art / "profile_export_aiperf.json").read_text())
    assert said["error_summary"] == [] and said["request_count"]["avg"] == 4
    assert said["output_sequence_length"]["min"] == said["output_sequence_length"]["max"] == 8
