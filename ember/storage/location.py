"""Where a run's files live: a local path, or an fsspec URL (s3://, gs://, az://, memory://, ...).

Local paths stay `pathlib.Path`s; a URL becomes a `upath.UPath` (universal-pathlib: pathlib's interface over
fsspec), so the code that lists, reads and writes a run's files is the same for both. Credentials and endpoints
come from the environment only (AWS_*, GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_*), read by the backend
(s3fs, gcsfs, adlfs): a URL carrying them (`s3://KEY:SECRET@bucket`) is refused, since ember writes the URLs it is
given into config.yaml and run.json.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Union

from ember.errors import ConfigError, UserFileNotFound, first_error_line

if TYPE_CHECKING:
    from upath import UPath

    from ember.config import JobConfig

Location = Union[Path, "UPath"]  # upath is imported only for URLs

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")

# The fsspec backend each object-store scheme needs, for the one-line error when it is not installed.
BACKENDS = {"s3": "s3fs", "s3a": "s3fs", "gs": "gcsfs", "gcs": "gcsfs", "az": "adlfs", "abfs": "adlfs",
            "abfss": "adlfs", "adl": "adlfs", "hf": "huggingface_hub", "http": "aiohttp", "https": "aiohttp"}


def scheme(value: object) -> str:
    """The URL scheme of `value` ("s3", "memory", ...), or "" for a local path (file:// included)."""
    match = _SCHEME.match(str(value))
    return "" if match is None or match.group(1).lower() == "file" else match.group(1).lower()


def is_url(value: object) -> bool:
    """Whether `value` names a remote location (any scheme but file://)."""
    return bool(scheme(value))


def as_path(value: Union[str, os.PathLike, Location]) -> Location:
    """A local Path (`~` expanded, file:// stripped), or a UPath for a URL (after `check_url`)."""
    if isinstance(value, Path):
        return value.expanduser()
    if not isinstance(value, str):  # a UPath already
        return value
    if not is_url(value):
        return Path(value[len("file://"):] if value.startswith("file://") else value).expanduser()
    check_url(value)
    from upath import UPath

    return UPath(value)


def check_url(url: str, key: str = "path") -> None:
    """A URL ember can use: no credentials in it, and the backend for its scheme installed."""
    if _carries_credentials(url):
        raise ConfigError(f"{key} {redact(url)} carries credentials in the URL; give them in the environment "
                          "(AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS, ...) instead: "
                          "ember writes the URLs it is given into config.yaml and run.json")
    name = scheme(url)
    try:
        import fsspec

        fsspec.get_filesystem_class(name)
    except (ImportError, ValueError) as err:
        package = BACKENDS.get(name)
        fix = f"pip install {package}" if package else "install the fsspec backend for it"
        known = "unknown URL scheme" if isinstance(err, ValueError) else "its fsspec backend is not installed"
        raise ConfigError(f"{key} {url}: {name}:// cannot be opened ({known}): {fix}") from None


def _carries_credentials(url: str) -> bool:
    # `user:secret@bucket/...`: a bucket's name holds no ':' or '@', and a secret may hold '/', which would end the
    # URL's host part for urlsplit; so the text up to the last '@' is looked at, not the parsed host
    rest = url.split("://", 1)[1]
    return "@" in rest and ":" in rest.rsplit("@", 1)[0]


def redact(url: str) -> str:
    """`url` without the user:secret it may carry, for an error message."""
    if not _carries_credentials(url):
        return url
    head, rest = url.split("://", 1)
    return f"{head}://***@{rest.rsplit('@', 1)[1]}"


def canonical(value: str) -> str:
    """How a location is recorded (a LoRA run's base, a DPO reference): a URL as given, a local path absolute."""
    return value.rstrip("/") if is_url(value) else str(Path(value).expanduser().resolve())


def check_reachable(location: Location, key: str, *, must_exist: bool) -> None:
    """Before any work: a remote location's bucket exists and the environment's credentials open it (and, with
    `must_exist`, the object or prefix itself is there). One line per problem: the bucket, the credentials, the
    endpoint. Nothing is written."""
    if isinstance(location, Path):
        return
    fs, path = location.fs, location.path
    bucket = path.strip("/").split("/", 1)[0]
    try:
        fs.ls(bucket, refresh=True) if bucket else None
        found = fs.exists(path)
    except FileNotFoundError:
        raise UserFileNotFound(f"{key} {location}: the bucket '{bucket}' does not exist; create it or fix the "
                               "URL") from None
    except PermissionError as err:
        raise ConfigError(f"{key} {location}: access denied ({first_error_line(err)}); check the credentials in "
                          "the environment (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, GOOGLE_APPLICATION_CREDENTIALS, "
                          "...)") from None
    except Exception as err:  # the backends raise their own types for a refused connection or a bad key
        if "Credentials" in type(err).__name__:  # botocore's NoCredentialsError, PartialCredentialsError
            raise ConfigError(f"{key} {location}: no credentials for it in the environment ({_gist(err)}); set "
                              "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or the backend's own "
                              "variables (GOOGLE_APPLICATION_CREDENTIALS, AZURE_STORAGE_*)") from None
        raise ConfigError(f"{key} {location}: cannot be reached ({_gist(err)}); check the endpoint "
                          "(AWS_ENDPOINT_URL for an S3-compatible server), the network and the credentials") from None
    if must_exist and not found:
        raise UserFileNotFound(f"{key} {location} does not exist")


def check_source_url(spec: str, key: str) -> None:
    """A data source given as a URL (a file, a folder, or a glob: its prefix before the first wildcard) is
    well-formed and there, before any work."""
    check_url(spec, key)
    wildcard = min((spec.index(c) for c in "*?[" if c in spec), default=None)
    location = spec if wildcard is None else spec[:wildcard].rpartition("/")[0]
    check_reachable(as_path(location), key, must_exist=True)


def check_input(value: object, key: str) -> None:
    """A command's input (a model, a run, a file) given as a URL: well-formed, its backend installed, its bucket
    reachable with the environment's credentials, and the object or prefix there; one line otherwise, before any
    work. A local path is left to the command's own checks."""
    if isinstance(value, str) and is_url(value):
        check_url(value, key)
        check_reachable(as_path(value), key, must_exist=True)


def check_output(value: object, key: str) -> None:
    """A command's output given as a URL: well-formed, its backend installed, its bucket reachable (the object
    itself may be new)."""
    if isinstance(value, str) and is_url(value):
        check_url(value, key)
        check_reachable(as_path(value), key, must_exist=False)


def _gist(err: BaseException) -> str:
    text = first_error_line(err)
    return text if len(text) < 200 else text[:200] + "..."


def remove_tree(location: Location) -> None:
    """Delete a file or directory tree, local or remote; nothing if it is not there."""
    if isinstance(location, Path):
        shutil.rmtree(location, ignore_errors=True) if location.is_dir() else location.unlink(missing_ok=True)
        return
    try:
        location.fs.rm(location.path, recursive=True)
    except FileNotFoundError:
        pass


def move(src: Location, dst: Location, last: tuple[str, ...] = ()) -> None:
    """Move a file or directory tree: a rename locally; copy then delete on an object store (no rename there),
    the objects named in `last` (a directory's commit marker: model.json, config.json) copied after the others."""
    if isinstance(src, Path):
        os.replace(src, dst)
        return
    fs, root, target = src.fs, src.path.rstrip("/"), dst.path.rstrip("/")
    # object by object: fsspec's recursive mv also copies the prefix itself, which is no object on S3
    found = fs.find(root)
    for path in sorted(found, key=lambda path: path.rsplit("/", 1)[-1] in last):
        fs.copy(path, target + path[len(root):])
    fs.rm(root, recursive=True)


# The run's keys that name a location: each may be a URL (the data sources are read from their local copies).
URL_KEYS = ("output_dir", "resume", "model.init_from", "data.dataset", "data.tokenizer")


def check_locations(cfg: JobConfig) -> None:
    """Each location key of a run: a URL in a well-formed form, with its fsspec backend installed."""
    for key in URL_KEYS:
        section, _, name = key.rpartition(".")
        value = getattr(getattr(cfg, section) if section else cfg, name)
        if isinstance(value, str) and is_url(value):
            check_url(value, key)
