"""The embedded tiny Gemma-4 (generated locally, deterministically) and the texts its tokenizer and prompts use.
"""
