"""Task scores of a served build beside its checkpoint's, through lm-eval: tasks (tasks.py), runs (harness.py)."""
