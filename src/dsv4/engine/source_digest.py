"""A digest of the ``dsv4`` package's own Python sources, for keys of what is stored on disk between runs (the
warm-up manifests, the stored step shapes): any change to the code the stored thing depends on changes its key."""

from __future__ import annotations

import hashlib
import os

__all__ = ["PACKAGE_DIR", "source_digest"]

#: The ``dsv4`` package directory.
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def source_digest(*parts: str) -> bytes:
    """SHA-256 (32 bytes) of every ``.py`` file under ``parts`` (folders or files relative to the package; none:
    the whole package), each hashed with its path and length so that no two different trees hash alike."""
    h = hashlib.sha256()
    for part in parts or ("",):
        top = os.path.join(PACKAGE_DIR, part)
        paths = [top] if os.path.isfile(top) else sorted(
            os.path.join(root, f) for root, _, files in os.walk(top) for f in files if f.endswith(".py")
        )
        for path in paths:
            with open(path, "rb") as fh:
                data = fh.read()
            name = os.path.relpath(path, PACKAGE_DIR).replace(os.sep, "/").encode()
            h.update(len(name).to_bytes(4, "little") + name + len(data).to_bytes(8, "little") + data)
    return h.digest()
