"""lm-eval, run twice on the same tasks: against ``serve`` of a version (``local-completions``, the OpenAI completions
client lm-eval and optimum-neuron's accuracy script use), and on the checkpoint it was built from through lm-eval's
transformers backend in fp32 on the CPU (the reference); then the two scores side by side, each task judged: the
served build may score below the reference by at most ``margin`` (absolute).

Both read the prompts with the checkpoint's own tokenizer as it is configured (its own special tokens: Gemma's
add a BOS token), so that both score the same token ids, the served build getting them as token-id prompts: the API
client's ``add_bos_token=True`` means "the tokenizer's special tokens", while the transformers backend's would load
the tokenizer with a BOS forced on, so it is left unset there. Writes nothing; lm-eval is imported here only (the
``[eval]`` extra).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from pipeline.evaluation.tasks import TASKS, Task


@dataclass(frozen=True)
class TaskScore:
    task: str
    metric: str
    served: float
    reference: float
    margin: float

    @property
    def passed(self) -> bool:
        return self.served >= self.reference - self.margin - 1e-9

    def as_json(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def served_model_args(base_url: str, model: str, checkpoint: Path, max_length: int) -> dict:
    """lm-eval's ``local-completions`` against ``serve`` at ``base_url``: token-id prompts from the checkpoint's
    tokenizer (no Hub lookup), greedy, one request at a time."""
    return {"base_url": f"{base_url}/v1/completions", "model": model, "tokenizer_backend": "huggingface",
            "tokenizer": str(checkpoint), "add_bos_token": True, "tokenized_requests": True,
            "max_length": max_length, "num_concurrent": 1, "max_retries": 1, "timeout": 600}


def reference_model_args(checkpoint: Path, max_length: int) -> dict:
    return {"pretrained": str(checkpoint), "dtype": "float32", "device": "cpu", "max_length": max_length}


def evaluate(model: str, model_args: dict, tasks_dir: Path, tasks: tuple[Task, ...], limit: int | None
             ) -> dict[str, float]:
    """One lm-eval run of ``tasks``, their files in ``tasks_dir`` (``write_tasks``): each task's score (its
    ``metric``)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[task.name for task in tasks],
                                  task_manager=TaskManager(include_path=str(tasks_dir)), limit=limit, batch_size=1,
                                  log_samples=False, random_seed=1234, numpy_random_seed=1234, torch_random_seed=1234,
                                  fewshot_random_seed=1234)
    return {task.name: float(out["results"][task.name][f"{task.metric},none"]) for task in tasks}


def compare(served: dict[str, float], reference: dict[str, float], margin: float,
            tasks: tuple[Task, ...] = TASKS) -> list[TaskScore]:
    return [TaskScore(t.name, t.metric, served[t.name], reference[t.name], margin) for t in tasks]


def table(scores: list[TaskScore]) -> str:
    lines = [f"  {'task':<24} {'metric':<12} {'served':>8} {'reference':>10} {'margin':>7}  result"]
    for s in scores:
        lines.append(f"  {s.task:<24} {s.metric:<12} {s.served:>8.4f} {s.reference:>10.4f} {s.margin:>7.3f}  "
                     f"{'ok' if s.passed else 'BELOW'}")
    return "\n".join(lines)
