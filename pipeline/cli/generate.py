"""``python -m pipeline generate RANK_DIR --checkpoint DIR --prompt TEXT``: run a pulled version.

Verifies the rank directory against its manifest (``RANK_DIR.manifest.json``, written by ``pull``, or a build folder's
``../dist/manifest.json``; a pulled version by pull's record of its files where they are unchanged since pull hashed
them, else by hashing them, as ``--verify-full`` always does), refuses a version this host cannot run (``pull``'s
rule, pipeline/backends/compatibility.py), loads the ranks through the backend that built them, and greedy-decodes a
chat prompt with the host-side embeddings (and, for host-prefill variants, the host prefill) taken from the original
checkpoint. Prints the reply on standard output and the timing on standard error. With ``--public-key`` the manifest
must first verify with the signature beside it (``RANK_DIR.manifest.sig``, or ``../dist/manifest.sig``), as ``pull
--offline`` checks it: an unsigned or edited one is refused before a byte is hashed.

    python -m pipeline generate /workspace/gemma4_e4b-512_bf16-ncc2.23.6484.0-1f0c9a7e \\
        --checkpoint /data/gemma-4-E4B-it --prompt "What is the capital of France?"
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from pipeline.artifact import signing
from pipeline.artifact.manifest import Manifest, manifest_of
from pipeline.artifact.pulled import reverified
from pipeline.backends import get_backend
from pipeline.cli import add_decode_threads, plain
from pipeline.cli.pull import host_toolchain, judged
from pipeline.core.errors import InputError, PipelineError
from pipeline.core.log import exit_on_error, log, setup
from pipeline.decoding.runner import DECODE_THREADS
from pipeline.models.tiny_model import MEANINGLESS, is_tiny
from pipeline.serving.engine import require_the_builds_checkpoint, require_tokenizer, text_prefix_of
from pipeline.validation.generation import Generator, new_tokens_problem
from pipeline.validation.prompts import chat_ids

DEFAULT_NEW_TOKENS = 64  # when --max-new-tokens is not given: this many, or what the cache holds if fewer


@dataclass(frozen=True)
class Generated:
    text: str
    prompt_tokens: int
    new_tokens: int
    ttft_ms: float
    tokens_per_s: float | None
    """None when it decoded no token after the first."""


def generate(rank_dir: Path, checkpoint: Path, prompt: str, max_new_tokens: int | None,
             text_prefix: str | None, verify_full: bool = False, decode_threads: int = DECODE_THREADS,
             public_key: str | None = None) -> Generated:
    from transformers import AutoTokenizer

    from pipeline.recipe.checkpoint import Checkpoint
    from pipeline.recipe.host import HostEmbeddings, HostPrefill
    from pipeline.recipe.spec import load_spec

    manifest = (signing.verified_manifest(manifest_of(rank_dir), public_key) if public_key
                else Manifest.read(manifest_of(rank_dir)))
    judged(manifest, host_toolchain())  # before any byte is hashed
    require_tokenizer(checkpoint)
    require_the_builds_checkpoint(checkpoint, manifest)
    build, _ = reverified(rank_dir, manifest, verify_full)
    shape = manifest.shape
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = chat_ids(tokenizer, prompt)
    # What the cache has room for, or refused now, before anything loads (serve's rule: never clamped in silence).
    problem = new_tokens_problem(len(ids), max_new_tokens, shape.kv_max, "--max-new-tokens")
    if problem:
        raise InputError(problem)
    new_tokens = max_new_tokens if max_new_tokens is not None else min(DEFAULT_NEW_TOKENS, shape.kv_max - len(ids))
    spec = load_spec(checkpoint)
    with Checkpoint(checkpoint, text_prefix or text_prefix_of(checkpoint)) as ckpt:
        ckpt.verify(spec)
        host = HostPrefill(ckpt, spec, shape.kv_max, shape.torch_dtype) if shape.prefill == "host" else None
        with get_backend(manifest.backend).load(build, shape) as runner:
            gen = Generator(runner, HostEmbeddings(ckpt, spec), spec.eos_token_ids, spec.pad_token_id, host,
                            decode_threads=decode_threads)
            out = gen.generate(ids, new_tokens)
    tokens = [t for t in out.tokens if t not in spec.eos_token_ids]
    decode_s = sum(out.decode_s)
    return Generated(tokenizer.decode(tokens, skip_special_tokens=True), len(ids), len(out.tokens),
                     round(out.ttft_s * 1e3, 1), round(len(out.decode_s) / decode_s, 1) if decode_s else None)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipeline generate", description=plain(__doc__),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("rank_dir", type=Path, help="the directory pull printed, or a packaged build folder "
                                                    "(artifacts/<model>/<variant>/build)")
    parser.add_argument("--checkpoint", type=Path, required=True,
                        help="the original checkpoint (tokenizer, config, embedding tables)")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=None,
                        help=f"new tokens to decode (default: {DEFAULT_NEW_TOKENS}, or what the cache holds if fewer); "
                             "more than the cache holds is refused, as serve refuses it")
    parser.add_argument("--text-prefix", help="override the decoder's tensor prefix in the checkpoint")
    parser.add_argument("--verify-full", action="store_true",
                        help="hash every rank file, even where pull's record vouches for them")
    parser.add_argument("--public-key", help="PEM public key the signature beside the manifest must verify with")
    add_decode_threads(parser)
    args = parser.parse_args(argv)
    setup()
    with exit_on_error():
        problem = signing.key_problem(args.public_key, "public", "--public-key") if args.public_key else None
        if problem:
            raise PipelineError(problem)
        result = generate(args.rank_dir.resolve(), args.checkpoint, args.prompt, args.max_new_tokens, args.text_prefix,
                          args.verify_full, args.decode_threads, args.public_key)
    print(result.text)
    if is_tiny(args.checkpoint):
        log.warning("generate: %s", MEANINGLESS)
    log.info("%d prompt tokens, %d new tokens, first token %.0f ms, %s tok/s", result.prompt_tokens,
             result.new_tokens, result.ttft_ms, result.tokens_per_s)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
