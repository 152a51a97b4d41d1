"""Where a remote run lives: its URI, the filesystem behind it, and the object-store calls rlreplay makes."""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlreplay.errors import StorageError
from rlreplay.format import redact as redaction

_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]+):/+(.*)$")  # also "s3:/b/p": a URI after Path() folded "//"
_USERINFO = re.compile(r"(://)[^/@\s]+@")
_QUERY_SECRET = re.compile(r"(?i)([?&][^=&\s]*(?:key|secret|token|password|credential)[^=&\s]*=)[^&\s]+")
_LOCAL_SCHEMES = ("file", "local")
_locations: dict[str, Location] = {}
_locations_lock = threading.Lock()


def as_uri(value: str | os.PathLike[str] | None) -> str | None:
    """The URI ``value`` names (``scheme://...``), or None for a local path (``file://`` is local)."""
    if value is None:
        return None
    match = _URI.match(os.fspath(value))
    if match is None or match.group(1).lower() in _LOCAL_SCHEMES:
        return None
    return f"{match.group(1).lower()}://{match.group(2)}"


def local_path(value: str | os.PathLike[str]) -> Path:
    """A local run path (``file://`` stripped)."""
    text = os.fspath(value)
    match = _URI.match(text)
    if match is not None and match.group(1).lower() in _LOCAL_SCHEMES:
        return Path("/" + match.group(2))
    return Path(text)


def redact(text: str) -> str:
    """Hide credentials a message may carry: URI user info, secret query values, env key values."""
    text = _QUERY_SECRET.sub(
        r"\1" + redaction.REDACTED, _USERINFO.sub(r"\1" + redaction.REDACTED + "@", text)
    )
    for name in ("AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_ACCESS_KEY_ID"):
        secret = os.environ.get(name)
        if secret and len(secret) >= 4:
            text = text.replace(secret, redaction.REDACTED)
    return redaction.redact_value(text)


def error_line(exc: BaseException) -> str:
    return redact(" ".join(str(exc).split())[:300] or type(exc).__name__)


@dataclass
class Location:
    """A run on a filesystem reached through pyarrow.fs: ``fs`` and the run's ``root`` path in it."""

    uri: str
    fs: Any
    root: str

    def path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    @property
    def name(self) -> str:
        return self.root.rstrip("/").rsplit("/", 1)[-1] or "run"

    @property
    def key(self) -> str:
        """A short stable name for this run's spool and cache folders (no credentials in it)."""
        bare = _USERINFO.sub(r"\1", self.uri.split("?", 1)[0]).rstrip("/")
        return hashlib.sha1(bare.encode()).hexdigest()[:16]

    def __repr__(self) -> str:
        return f"Location({redact(self.uri)!r})"


def location(uri: str) -> Location:
    """The filesystem and root of a run URI (cached per process)."""
    with _locations_lock:
        loc = _locations.get(uri)
        if loc is None:
            loc = _locations[uri] = _make_location(uri)
        return loc


def _make_location(uri: str) -> Location:
    import pyarrow.fs as pafs

    scheme, _, rest = uri.partition("://")
    rest = rest.split("?", 1)[0].rstrip("/")
    if not rest or not rest.split("/", 1)[0]:
        raise StorageError(f"{redact(uri)}: no bucket or path in the URI")
    if scheme in ("s3", "s3a"):
        return Location(uri, _s3_filesystem(pafs), rest)
    if scheme in ("gs", "gcs"):
        return Location(uri, pafs.GcsFileSystem(retry_time_limit_seconds=10), rest)
    try:
        fs, root = pafs.FileSystem.from_uri(uri)
        return Location(uri, fs, root.rstrip("/"))
    except (ValueError, OSError):
        pass  # not a pyarrow filesystem: try fsspec's
    try:
        import fsspec
        from pyarrow.fs import FSSpecHandler, PyFileSystem

        fs, root = fsspec.core.url_to_fs(uri)
        return Location(uri, PyFileSystem(FSSpecHandler(fs)), str(root).rstrip("/"))
    except ImportError as exc:
        raise StorageError(
            f"{redact(uri)}: no filesystem for {scheme}:// (install fsspec and its {scheme} package)"
        ) from exc
    except Exception as exc:
        raise StorageError(f"{redact(uri)}: {error_line(exc)}") from exc


def _s3_filesystem(pafs: Any) -> Any:
    """pyarrow's S3 with the standard environment; ``AWS_ENDPOINT_URL[_S3]`` picks another endpoint."""
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    kwargs: dict[str, Any] = {
        "connect_timeout": 2.0,
        "request_timeout": 10.0,
        "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=2),
    }
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        kwargs["region"] = region
    if endpoint:
        scheme, sep, host = endpoint.partition("://")
        kwargs["endpoint_override"] = host.rstrip("/") if sep else endpoint
        if sep:
            kwargs["scheme"] = scheme
        kwargs.setdefault("region", "us-east-1")
    return pafs.S3FileSystem(**kwargs)


def is_object_store(fs: Any) -> bool:
    return fs.type_name in ("s3", "gcs", "abfs")


def upload_file(loc: Location, local: Path, rel: str) -> int:
    """Copy one local file to ``rel`` under the run, visible only once whole; returns its size."""
    data = local.read_bytes()
    target = loc.path(rel)
    fs = loc.fs
    if is_object_store(fs):  # an object appears only when its upload completes
        with fs.open_output_stream(target) as out:
            out.write(data)
        return len(data)
    parent = target.rsplit("/", 1)[0]
    fs.create_dir(parent, recursive=True)
    tmp = f"{parent}/_{target.rsplit('/', 1)[1]}.{os.getpid()}.tmp"
    with fs.open_output_stream(tmp) as out:
        out.write(data)
    fs.move(tmp, target)
    return len(data)


def read_bytes(loc: Location, rel: str) -> bytes:
    with loc.fs.open_input_stream(loc.path(rel)) as f:
        return f.read()


def exists(loc: Location, rel: str) -> bool:
    import pyarrow.fs as pafs

    return loc.fs.get_file_info(loc.path(rel)).type != pafs.FileType.NotFound


def bucket_exists(loc: Location, bucket: str) -> bool:
    import pyarrow.fs as pafs

    return loc.fs.get_file_info(bucket).type != pafs.FileType.NotFound


def list_objects(loc: Location, rel: str) -> list[Any]:
    """Every file under ``rel`` (recursive), as pyarrow FileInfo; [] when there is none."""
    import pyarrow.fs as pafs

    infos = loc.fs.get_file_info(pafs.FileSelector(loc.path(rel), recursive=True, allow_not_found=True))
    return [i for i in infos if i.type == pafs.FileType.File]


def list_dirs(loc: Location, rel: str) -> list[str]:
    """Names of the folders right under ``rel`` (one listing, not recursive); [] when there is none."""
    import pyarrow.fs as pafs

    infos = loc.fs.get_file_info(pafs.FileSelector(loc.path(rel), recursive=False, allow_not_found=True))
    return [i.base_name for i in infos if i.type == pafs.FileType.Directory]


def write_json(loc: Location, rel: str, data: dict[str, Any]) -> None:
    payload = json.dumps(data, indent=2, sort_keys=True, default=str).encode()
    with loc.fs.open_output_stream(loc.path(rel)) as out:
        out.write(payload)
