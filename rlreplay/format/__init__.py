"""The file format: the span schema, the run manifest, the payload codec, the trajectory index, redaction."""
