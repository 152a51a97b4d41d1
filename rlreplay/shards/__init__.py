"""Span files on disk: live append-only streams, their compaction, and recovery after a crash.

Layout under a run directory::

    spans/step=5/worker=w0/_part-<uid>.partial   live Arrow IPC stream, ignored by scans
    spans/step=5/worker=w0/part-<uid>.parquet    sealed: sorted, Parquet zstd, queryable
    spans/step=5/worker=w0/part-<uid>.index      its trajectory index (``rlreplay.format.index``)

Sealed files are cut into row groups at trajectory boundaries (about ``ROW_GROUP_BYTES`` of
payload each), so one trajectory is read without the rest of its step.

A sealed file is written under a temporary name, fsynced and renamed; names are never reused,
and the partial is deleted only once its sealed file is durable.
"""
