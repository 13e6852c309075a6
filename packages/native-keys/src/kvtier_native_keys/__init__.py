"""Chained page keys for kvtier in one native call.

``chain_sha256(root, data, page_bytes)`` returns the concatenated 32-byte keys
``key_i = SHA-256(key_{i-1} || page_i)`` of the ``len(data) // page_bytes`` pages of ``data``
(``data``: any C-contiguous buffer whose length is a multiple of ``page_bytes``), starting from
``key_{-1} = root``, computed with OpenSSL's libcrypto; ``keys_sha256`` returns the same keys as
a list of 32-byte ``bytes``. It is the loop of ``kvtier.keys.PageKeyer.keys`` without a
Python-level hash call per page; kvtier-core uses it automatically when this package is
installed (``KVTIER_NATIVE_KEYS=0`` turns that off). Inputs of 64 KiB and more are hashed with
the GIL released.
"""

from __future__ import annotations

from typing import Callable

from ._chain import BACKEND, OPENSSL_VERSION, chain_sha256, keys_sha256
from ._version import __version__

#: Key length of every chain (bytes).
KEY_BYTES = 32
#: hash name (as kvtier's ``KeyNamespace.hash`` spells it) -> ``keys(root, data, page_bytes)``
#: returning the list of keys.
CHAINS: dict[str, Callable[..., list[bytes]]] = {"sha256": keys_sha256}

__all__ = ["BACKEND", "CHAINS", "KEY_BYTES", "OPENSSL_VERSION", "__version__", "chain_sha256",
           "keys_sha256"]
