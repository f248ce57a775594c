"""The task set ``python -m pipeline eval`` scores: lm-eval tasks over data files shipped beside this module (nothing
is downloaded), one of each kind lm-eval has: a multiple-choice task scored by log-likelihood (what ``echo`` and the
prompt's log-probabilities serve) and a generation task scored by exact match. Short, zero-shot prompts: a real E4B
build's 512 positions hold them. ``write_tasks`` writes them as lm-eval task files into a folder lm-eval includes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DATA = Path(__file__).parent / "data"


@dataclass(frozen=True)
class Task:
    name: str
    """lm-eval's task name."""
    data: str
    """Its JSON lines file in ``DATA``."""
    metric: str
    """The score compared (lm-eval's metric name)."""
    config: dict
    """lm-eval's task settings beside the dataset's."""


TASKS = (
    Task("gemma4_capitals_mc", "capitals_mc.jsonl", "acc", {
        "output_type": "multiple_choice",
        "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    }),
    Task("gemma4_short_answers", "short_answers.jsonl", "exact_match", {
        "output_type": "generate_until",
        "doc_to_text": "Question: {{question}}\nAnswer:",
        "doc_to_target": "{{answer}}",
        "generation_kwargs": {"until": ["\n", "."], "max_gen_toks": 8, "do_sample": False, "temperature": 0.0},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                         "ignore_case": True, "ignore_punctuation": True, "regexes_to_ignore": [" "]}],
    }),
)


def task_named(name: str) -> Task:
    for task in TASKS:
        if task.name == name:
            return task
    raise KeyError(name)


def write_tasks(folder: Path, tasks: tuple[Task, ...] = TASKS) -> list[str]:
    """Each task's lm-eval file in ``folder`` (JSON, which lm-eval's YAML reader takes), its data by absolute path;
    returns their names."""
    folder.mkdir(parents=True, exist_ok=True)
    for task in tasks:
        config = {"task": task.name, "dataset_path": "json",
                  "dataset_kwargs": {"data_files": {"test": str((DATA / task.data).resolve())}},
                  "test_split": "test", **task.config}
        (folder / f"{task.name}.yaml").write_text(json.dumps(config, indent=1) + "\n")
    return [task.name for task in tasks]
