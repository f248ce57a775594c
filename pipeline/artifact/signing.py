"""Signing a manifest with OpenSSF model_signing (bring-your-own elliptic-curve key, offline), and verifying it.

The manifest binds the archive and every rank file by sha256, so signing the manifest signs the whole artifact
without hashing gigabytes again. The signature (``manifest.sig``, a Sigstore bundle) covers every file of the
artifact folder except the archive (bound through the manifest) and itself: a changed manifest, a foreign key or an
extra file in the folder fails verification.

Make a key pair with ``KEYGEN``: the private key outside the checkout (``~/.config/gemma4-neuron-pipeline/``, readable
by its owner only: a key in the tree is one ``git add .`` away from a commit, and .gitignore refuses ``*.pem`` there
too), the public one beside it to hand out.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

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


def verify(folder: Path, archive_name: str | None, public_key: str | bytes) -> None:
    """Raise ``IntegrityError`` unless ``folder/manifest.sig`` is a valid signature of the folder by ``public_key``."""
    from model_signing import verifying

    folder = Path(folder).resolve()
    signature = folder / SIGNATURE
    if not signature.is_file():
        raise IntegrityError(f"{folder} has no {SIGNATURE}: the artifact is unsigned")
    jsonio.read(signature, MAX_SIGNATURE_BYTES)  # model_signing parses it unbounded: its size and depth first
    with tempfile.TemporaryDirectory() as tmp:
        if isinstance(public_key, bytes):
            key_path = Path(tmp) / "key.pub.pem"
            key_path.write_bytes(public_key)
            public_key = str(key_path)
        public_key = str(Path(public_key).expanduser())
        try:
            verifying.Config().use_elliptic_key_verifier(public_key=public_key) \
                .set_hashing_config(_hashing(folder, archive_name)).verify(folder, signature)
        except ValueError as exc:
            raise IntegrityError(f"signature check of {folder} failed: {exc}") from None


def check(folder: Path, archive_name: str | None, public_key: str | bytes | None, allow_unsigned: bool,
          what: str) -> str:
    """The signing policy: verify when a key is given; accept an unverified artifact only when allowed.

    Returns how the artifact was accepted: ``"verified"`` or ``"unsigned (allowed)"``.
    """
    signed = (Path(folder) / SIGNATURE).is_file()
    if public_key is not None:
        verify(folder, archive_name, public_key)
        return "verified"
    if not allow_unsigned:
        state = "is signed but no public key was given to check it" if signed else "is not signed"
        raise IntegrityError(f"{what} {state}: give the public key (package.signing.public_key, or --public-key "
                             "for pull and serve), or accept unverified artifacts explicitly "
                             "(package.signing.allow_unsigned=true, or --allow-unsigned)")
    return "unsigned (allowed)"
