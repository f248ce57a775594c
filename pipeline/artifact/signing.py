"""Signing a manifest with OpenSSF model_signing (bring-your-own elliptic-curve key, offline), and verifying it.

The manifest binds the archive and every rank file by sha256, so signing the manifest signs the whole artifact
without hashing gigabytes again. The signature (``manifest.sig``, a Sigstore bundle) covers every file of the
artifact folder except the archive (bound through the manifest) and itself: a changed manifest, a foreign key or an
extra file in the folder fails verification.

A signature file is input from outside like the manifest: it is read within bounds, its shape (what model_signing
indexes into unchecked) is checked first, and whatever model_signing raises over it is a refusal naming the file, in
one line: a malformed bundle fails closed without a traceback.

With a public key, a directory ``pull`` printed, or a build folder, is used only through ``verified_manifest``: its
manifest checked against the signature beside it as ``pull --offline`` checks a version it kept (``serve`` and
``generate``).

Make a key pair with ``KEYGEN``: the private key outside the checkout (``~/.config/gemma4-neuron-pipeline/``, readable
by its owner only: a key in the tree is one ``git add .`` away from a commit, and .gitignore refuses ``*.pem`` there
too), the public one beside it to hand out.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from pathlib import Path
from typing import Any

from pipeline.artifact.manifest import Manifest
from pipeline.core import jsonio
from pipeline.core.errors import IntegrityError

SIGNATURE = "manifest.sig"
MANIFEST = "manifest.json"
MAX_SIGNATURE_BYTES = 256 << 10  # a Sigstore bundle over one file is a few KB
KEY_DIR = "~/.config/gemma4-neuron-pipeline"
KEYGEN = (f"mkdir -p {KEY_DIR} && (umask 077 && openssl ecparam -name prime256v1 -genkey -noout -out "
          f"{KEY_DIR}/signing-key.pem) && openssl ec -in {KEY_DIR}/signing-key.pem -pubout -out "
          f"{KEY_DIR}/signing-key.pub.pem")


def _hashing(folder: Path, archive_name: str | None):
    """What the signature covers: the folder but the signature and the archive (None: not there yet, as when pull
    checks a manifest's signature before anything else is downloaded)."""
    from model_signing import hashing

    ignored = [folder / SIGNATURE] + ([folder / archive_name] if archive_name else [])
    return hashing.Config().set_ignored_paths(paths=ignored)


def key_problem(path: str, kind: str, setting: str) -> str | None:
    """Why ``path`` is not a usable PEM key of ``kind`` ('private' or 'public'), or None."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    try:
        data = Path(path).expanduser().read_bytes()
    except OSError as exc:
        return f"{setting}={path!r} cannot be read ({exc.strerror}); make a key pair with: {KEYGEN}"
    try:
        key = (serialization.load_pem_private_key(data, password=None) if kind == "private"
               else serialization.load_pem_public_key(data))
    except (ValueError, TypeError) as exc:
        return f"{setting}={path!r} is not a PEM {kind} key ({exc}); make a key pair with: {KEYGEN}"
    if not isinstance(key, (ec.EllipticCurvePrivateKey, ec.EllipticCurvePublicKey)):
        return f"{setting}={path!r} is not an elliptic-curve key; make a key pair with: {KEYGEN}"
    return None


def public_key_pem(private_key: str) -> bytes:
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(Path(private_key).expanduser().read_bytes(), password=None)
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def sign(folder: Path, archive_name: str, private_key: str) -> Path:
    """Sign ``folder/manifest.json`` (and anything else beside it but the archive) into ``folder/manifest.sig``."""
    from model_signing import signing

    folder = Path(folder).resolve()
    signature = folder / SIGNATURE
    signature.unlink(missing_ok=True)
    signing.Config().use_elliptic_key_signer(private_key=str(Path(private_key).expanduser())) \
        .set_hashing_config(_hashing(folder, archive_name)).sign(folder, signature)
    return signature


# What model_signing reads of a bundle by indexing into it, before any of it is checked (sign_sigstore_pb's
# Signature.read, then the verifier): there a missing key is a KeyError, a null a TypeError, an empty list an
# IndexError. Each (path, type, required), parents before their children; the rest of a bundle is model_signing's to
# judge (pydantic's ValueError).
BUNDLE_SHAPE: tuple[tuple[tuple[str | int, ...], type, bool], ...] = (
    (("mediaType",), str, True),
    (("verificationMaterial",), dict, True),
    (("verificationMaterial", "publicKey"), dict, False),
    (("dsseEnvelope",), dict, True),
    (("dsseEnvelope", "payload"), str, True),
    (("dsseEnvelope", "payloadType"), str, True),
    (("dsseEnvelope", "signatures"), list, True),
    (("dsseEnvelope", "signatures", 0), dict, True),
    (("dsseEnvelope", "signatures", 0, "sig"), str, True),
)
# What model_signing (and pydantic, base64 and json under it) raises over a bundle it cannot check, the shape above
# passed (cryptography's InvalidSignature is caught beside these).
_REFUSALS = (ValueError, KeyError, TypeError, IndexError, AttributeError)
_KINDS = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}


def _dotted(path: tuple[str | int, ...]) -> str:
    return "".join(f"[{step}]" if isinstance(step, int) else f".{step}" for step in path).lstrip(".")


def bundle_problem(bundle: Any) -> str | None:
    """What makes ``bundle`` (a signature file, parsed) other than the shape of a Sigstore bundle, or None."""
    if not isinstance(bundle, dict):
        return f"it is {_KINDS.get(type(bundle), 'a number')}, not an object"
    for path, expected, required in BUNDLE_SHAPE:
        parent = bundle
        for step in path[:-1]:  # each parent's type was checked before: the shape lists parents first
            parent = parent[step]
        step = path[-1]
        if isinstance(step, int) and step >= len(parent):
            return f"{_dotted(path[:-1])} is an empty list"
        if isinstance(step, str) and step not in parent:
            if required:
                return f"it has no {_dotted(path)}"
            continue
        if not isinstance(parent[step], expected):
            return f"{_dotted(path)} is {_KINDS.get(type(parent[step]), 'a number')}, not {_KINDS[expected]}"
    return None


def _one_line(exc: BaseException) -> str:
    """``exc`` as a short line (pydantic's messages span several; a KeyError's is only the key)."""
    text = " ".join(str(exc).split())
    if not isinstance(exc, ValueError) or not text:
        text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def verify(folder: Path, archive_name: str | None, public_key: str | bytes, named: str | None = None) -> None:
    """Raise ``IntegrityError`` unless ``folder/manifest.sig`` is a valid signature of the folder by ``public_key``.

    ``named`` is how the messages name the signature file (default: "the signature", for a caller that names it
    itself): the folder a caller made for the check is no name a user knows. Every refusal is one line.
    """
    from cryptography.exceptions import InvalidSignature
    from model_signing import verifying

    folder = Path(folder).resolve()
    signature = folder / SIGNATURE
    if not signature.is_file():
        raise IntegrityError(f"{folder} has no {SIGNATURE}: the artifact is unsigned")
    named = named or "the signature"
    # model_signing parses it unbounded: within its bounds here first, named as the caller names it
    problem = bundle_problem(jsonio.read(signature, MAX_SIGNATURE_BYTES, named=named))
    if problem:
        raise IntegrityError(f"{named} is not a signature bundle ({problem}): refusing it; fetch it again, or ask "
                             "its publisher to sign it again")
    with tempfile.TemporaryDirectory() as tmp:
        if isinstance(public_key, bytes):
            key_path = Path(tmp) / "key.pub.pem"
            key_path.write_bytes(public_key)
            public_key = str(key_path)
        public_key = str(Path(public_key).expanduser())
        # model_signing prints its warnings (an old-format bundle: one whose unsigned key hint was removed) on
        # standard output, which is the path in DIR=$(pull ...): they go to standard error
        try:
            with contextlib.redirect_stdout(sys.stderr):
                verifying.Config().use_elliptic_key_verifier(public_key=public_key) \
                    .set_hashing_config(_hashing(folder, archive_name)).verify(folder, signature)
        except InvalidSignature:
            raise IntegrityError(f"signature check of {named} failed: its signature bytes are not this public key's "
                                 "signature of its payload") from None
        except _REFUSALS as exc:
            raise IntegrityError(f"signature check of {named} failed: {_one_line(exc)}") from None


def verified_manifest(manifest_path: Path, public_key: str | bytes) -> Manifest:
    """The manifest at ``manifest_path`` (a pulled version's ``<root>.manifest.json``, or a build folder's
    ``dist/manifest.json``), checked against the signature beside it (``<root>.manifest.sig``, ``dist/manifest.sig``)
    as ``pull --offline`` checks a version it kept: both copied alone into a folder of their own (the signature covers
    every file there), verified, and the manifest parsed from the very bytes that were verified."""
    signature = manifest_path.with_suffix(".sig")
    if not signature.is_file():
        raise IntegrityError(f"{manifest_path} has no signature beside it ({signature.name}): it is unsigned, or its "
                             "signature was removed, and with --public-key only what that key signed is used; pull "
                             "the version again with --public-key")
    raw = jsonio.read_bytes(manifest_path, Manifest.MAX_BYTES)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / MANIFEST).write_bytes(raw)
        (Path(tmp) / SIGNATURE).write_bytes(jsonio.read_bytes(signature, MAX_SIGNATURE_BYTES))
        verify(Path(tmp), None, public_key, named=str(signature))
    return Manifest.from_bytes(raw, str(manifest_path))


def check(folder: Path, archive_name: str | None, public_key: str | bytes | None, allow_unsigned: bool,
          what: str) -> str:
    """The signing policy: verify when a key is given; accept an unverified artifact only when allowed.

    Returns how the artifact was accepted: ``"verified"`` or ``"unsigned (allowed)"``.
    """
    signed = (Path(folder) / SIGNATURE).is_file()
    if public_key is not None:
        verify(folder, archive_name, public_key, named=f"the {SIGNATURE} of {what}")
        return "verified"
    if not allow_unsigned:
        state = "is signed but no public key was given to check it" if signed else "is not signed"
        raise IntegrityError(f"{what} {state}: give the public key (package.signing.public_key, or --public-key "
                             "for pull and serve), or accept unverified artifacts explicitly "
                             "(package.signing.allow_unsigned=true, or --allow-unsigned)")
    return "unsigned (allowed)"
