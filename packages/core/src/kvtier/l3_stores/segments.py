"""The `file` store's ``segments`` format now lives in ``kvtier.l3_stores.file.segments``
(with its parts ``segment_index``, ``segment_capacity``, ``segment_reads`` and
``segment_writes``); this module keeps the old import path."""

from .file.segment_index import LOG_SUFFIX, REC_BYTES, SEG_DIR, SEG_SUFFIX, pack_record, \
    unpack_record
from .file.segments import SegmentFormat

__all__ = ["LOG_SUFFIX", "REC_BYTES", "SEG_DIR", "SEG_SUFFIX", "SegmentFormat", "pack_record",
           "unpack_record"]
