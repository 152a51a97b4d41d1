"""Runs on object stores (``s3://``, ``gs://``, pyarrow or fsspec filesystems): location, publisher, cache."""
