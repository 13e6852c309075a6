"""`file`: KV pages in a directory on local disk, read straight into host pages.

The store (entry point ``kvtier.l3_stores.file:FileStore``), one module per concept:

- ``store``: ``FileStore`` and its ``Config``, the public face (batch operations, stats).
- ``format``: the object format -- key names, the trailer, checksums, the store's identity.
- ``directory``: the root, the store directory, the manifest, read-only and O_DIRECT probes,
  fan-out directories.
- ``objects``: the ``objects`` format (one file per page): its index, eviction and I/O.
- ``ranged``: ranged reads of layer groups (``batch_get_layers``), shared by both formats.
- ``segments``: the ``segments`` format (the default), described there, in parts:
  ``segment_index`` (names, log records, the index and catching up), ``segment_capacity``
  (capacity and eviction), ``segment_reads`` and ``segment_writes`` (runs, lanes, deletes).
- ``core``: what every part shares (state, read-only mode, counters, the I/O threads).
- ``_files``: safe file helpers (opening without following links or blocking, whole-buffer
  I/O, writers' liveness); ``_hotio``: segment I/O with the checksum taken in the CPU cache.
"""

from .format import (_CHECKSUMS, DIRECT_ALIGN, FORMAT_VERSION, MAGIC, MANIFEST, MAX_HEX_KEY,
                     OLDER_VERSIONS, SUFFIX, TMP_SUFFIX, TRAILER_BYTES, check_trailer,
                     checksum_impl, identity_digest, identity_record, key_filename,
                     layer_groups, pack_trailer, parse_trailer)
from .store import FileStore

__all__ = ["DIRECT_ALIGN", "FORMAT_VERSION", "MAGIC", "MANIFEST", "MAX_HEX_KEY",
           "OLDER_VERSIONS", "SUFFIX", "TMP_SUFFIX", "TRAILER_BYTES", "_CHECKSUMS", "FileStore",
           "check_trailer", "checksum_impl", "identity_digest", "identity_record",
           "key_filename", "layer_groups", "pack_trailer", "parse_trailer"]
