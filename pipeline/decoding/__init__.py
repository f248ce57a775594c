"""Decoding over a loaded build, one sequence or many at once: the layer validation, ``generate`` and ``serve`` share.

Three nouns and one loop (nano-vllm's shape): a ``Sequence`` is one request's state (sequence.py); the ``Scheduler``
decides, with no I/O, what the next call into the build is: one prefill call of one sequence, or one decode step of
every sequence decoding (scheduler.py); the ``BatchRunner`` is the only code that knows the graphs: it turns
sequences into their inputs, calls the ranks and hands back each row's logits (runner.py); ``BatchEngine.step`` is
the loop: schedule, run, hand each sequence its token (engine.py).
"""
