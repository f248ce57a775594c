"""Validation prompts: chat-templated, filled with the shipped passages up to a token budget.

A prompt is defined by a token budget rather than a text so that the same configuration gives a prompt near each
bucket size for any tokenizer (the tiny model's and E4B's split the same text very differently).
"""

from __future__ import annotations

from pipeline.config import PromptConfig
from pipeline.models.texts import PASSAGES
from pipeline.validation.reference_records import Prompt


def messages_ids(tokenizer, messages: list[dict]) -> list[int]:
    """The chat template applied to ``messages`` (role and text content each), with the generation prompt."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def chat_ids(tokenizer, content: str) -> list[int]:
    return messages_ids(tokenizer, [{"role": "user", "content": content}])


def build_prompt(tokenizer, prompt: PromptConfig) -> tuple[str, list[int]]:
    """The longest ``passages + question`` whose templated form has at most ``max_tokens`` tokens.

    Words are added one at a time from the passages (repeated as needed); a prompt whose question alone exceeds
    the budget is returned as the bare question.
    """
    words = " ".join(PASSAGES).split()
    ids = chat_ids(tokenizer, prompt.question)
    if len(ids) >= prompt.max_tokens:
        return prompt.question, ids
    best = (prompt.question, ids)
    low, high = 0, len(words) * (1 + 4 * prompt.max_tokens // max(1, len(words)))
    # Token counts grow with the number of words: binary search for the most words that fit.
    while low < high:
        mid = (low + high + 1) // 2
        body = " ".join(words[i % len(words)] for i in range(mid))
        text = f"{body}\n\n{prompt.question}"
        candidate = chat_ids(tokenizer, text)
        if len(candidate) <= prompt.max_tokens:
            low, best = mid, (text, candidate)
        else:
            high = mid - 1
    return best


def build_prompts(tokenizer, prompts: list[PromptConfig]) -> list[Prompt]:
    out = []
    for prompt in prompts:
        text, ids = build_prompt(tokenizer, prompt)
        out.append(Prompt(prompt.name, prompt.max_tokens, text, tuple(ids)))
    return out
