"""The compiled-kernel cache: one key function, an in-process dict, and a disk store.

The disk store is a flat directory (``ATTNLANG_CACHE_DIR``, else the user cache dir)::

    <key>.cubin        one entry: header + JSON metadata + cubin (format below)
    <key>.lock         filelock; held while one process compiles <key>
    failed/<key>.cu    numbered source of a compile that failed (bug reports)

An entry file is ``HEADER | metadata (UTF-8 JSON) | payload (cubin)`` where ``HEADER`` is
``magic (8 bytes) | format version (u32) | metadata length (u32) | payload length (u64) |
sha256(metadata + payload) (32 bytes)``, little-endian. An entry that fails any of these
checks is a miss: it is removed and rebuilt, never trusted and never fatal. Entries are
written to a temp file in the same directory and renamed into place, so readers see a whole
entry or none; `locked` makes concurrent processes compile a given key once.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import struct
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from attnlang import env

__all__ = [
    "FORMAT_VERSION", "cache_key", "strip_line_directives", "cache_dir", "entry_path",
    "read_entry", "write_entry", "locked", "dump_failed", "list_entries", "clear_cache",
    "memory_get", "memory_put", "clear_memory_cache",
]

# Bump when the entry layout, the metadata, or what compile options mean changes: it is part
# of every key (through the toolchain fingerprint) and of every entry header.
FORMAT_VERSION = 2  # 2: whole cubins (1 lost the last byte to CuPy's getCUBIN)

_MAGIC = b"ATTNLCUB"
_HEADER = struct.Struct("<8sIIQ32s")
# A process holding a lock longer than this is stuck; flock locks die with their process, so
# this only fires on a genuinely hung compile or a filesystem that ignores flock.
_LOCK_TIMEOUT_S = 900.0

_LINE_DIRECTIVE = re.compile(r"^[ \t]*#[ \t]*line\b[^\n]*\n?", re.MULTILINE)
# With these options the cubin embeds #line positions, so they must stay in the key.
_LINE_INFO_OPTIONS = ("-lineinfo", "--generate-line-info", "-G", "--device-debug")


def strip_line_directives(source: str) -> str:
    """The source without its ``#line`` directives (whole lines removed).

    Example: ``'#line 7 "a.attn"\\nx;\\n'`` -> ``'x;\\n'``.
    """
    return _LINE_DIRECTIVE.sub("", source)


def cache_key(source: str, arch: str, options: Sequence[str], toolchain: str) -> str:
    """The one cache key: hex sha256 over the source, arch, sorted options and toolchain.

    ``#line`` directives are stripped first, so the same kernel spliced from another file or
    line hits the same entry (unless an option asks for line info, which bakes them into the
    cubin). Never hashes paths: include directories are not options here, and the toolchain
    string names versions, not locations.
    """
    keep_lines = any(o.split("=")[0] in _LINE_INFO_OPTIONS for o in options)
    text = source if keep_lines else strip_line_directives(source)
    h = hashlib.sha256()
    for part in (text, arch, "\0".join(sorted(options)), toolchain):
        data = part.encode()
        # Length-prefix each field so no two different tuples hash the same bytes.
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def cache_dir() -> Path:
    """The cache directory (``ATTNLANG_CACHE_DIR`` or the user cache dir); may not exist."""
    return env.cache_dir()


def entry_path(key: str) -> Path:
    """Where the entry for `key` lives (whether or not it exists)."""
    return cache_dir() / f"{key}.cubin"


def _encode(meta: dict[str, Any], payload: bytes) -> bytes:
    meta_bytes = json.dumps(meta, sort_keys=True).encode()
    digest = hashlib.sha256(meta_bytes + payload).digest()
    header = _HEADER.pack(_MAGIC, FORMAT_VERSION, len(meta_bytes), len(payload), digest)
    return header + meta_bytes + payload


def _decode(blob: bytes, key: str) -> tuple[dict[str, Any], bytes]:
    """Metadata and payload of an entry; ValueError says why it cannot be trusted."""
    if len(blob) < _HEADER.size:
        raise ValueError(f"truncated: {len(blob)} bytes, shorter than the header")
    magic, version, meta_len, payload_len, digest = _HEADER.unpack_from(blob)
    if magic != _MAGIC:
        raise ValueError("not an attnlang cache entry (bad magic)")
    if version != FORMAT_VERSION:
        raise ValueError(f"format version {version}, expected {FORMAT_VERSION}")
    if len(blob) != _HEADER.size + meta_len + payload_len:
        raise ValueError(
            f"length {len(blob)} bytes, header says {_HEADER.size + meta_len + payload_len}"
        )
    body = memoryview(blob)[_HEADER.size:]
    if hashlib.sha256(body).digest() != digest:
        raise ValueError("checksum mismatch")
    meta = json.loads(bytes(body[:meta_len]))
    if not isinstance(meta, dict) or meta.get("key") != key:
        raise ValueError("holds another key")
    return meta, bytes(body[meta_len:])


def read_entry(key: str) -> tuple[dict[str, Any], bytes, Path] | None:
    """(metadata, payload, path) of the verified entry for `key`, or None on a miss.

    An entry that does not verify is removed (and reported on stderr unless quiet) so the
    caller rebuilds it.
    """
    path = entry_path(key)
    try:
        blob = path.read_bytes()
    except OSError:
        return None
    try:
        meta, payload = _decode(blob, key)
    except ValueError as e:  # includes json and unicode errors
        if not env.quiet():
            print(f"attnlang: cache entry {path} is corrupt ({e}); rebuilding",
                  file=sys.stderr, flush=True)
        with contextlib.suppress(OSError):
            path.unlink()
        return None
    return meta, payload, path


def write_entry(key: str, meta: dict[str, Any], payload: bytes) -> Path:
    """Atomically write the entry for `key` (temp file + rename); returns its path.

    `meta` must be JSON-serialisable; its "key" field is set to `key`. Raises OSError if the
    cache directory is not writable.
    """
    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    blob = _encode({**meta, "key": key}, payload)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{key}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, directory / f"{key}.cubin")
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return directory / f"{key}.cubin"


@contextlib.contextmanager
def locked(key: str) -> Iterator[None]:
    """Hold the cross-process lock for `key` (``<key>.lock``) for the duration of the block.

    Raises OSError if the cache directory cannot be created, and RuntimeError if another
    process holds the lock for more than 15 minutes.
    """
    import filelock

    directory = cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    lock_path = directory / f"{key}.lock"
    try:
        with filelock.FileLock(str(lock_path), timeout=_LOCK_TIMEOUT_S):
            yield
    except filelock.Timeout as e:
        raise RuntimeError(
            f"waited {_LOCK_TIMEOUT_S:.0f} s for another process compiling the same kernel "
            f"(lock {lock_path}); if no attnlang process is running, delete that file"
        ) from e


def dump_failed(key: str, source: str, header: str) -> Path:
    """Write `source` with line numbers to ``<cache>/failed/<key>.cu``; returns the path.

    `header` (the compiler log, options...) goes first as a comment. Falls back to the
    system temp directory when the cache directory is not writable.
    """
    width = len(str(source.count("\n") + 1))
    numbered = "".join(
        f"{i:>{width}} | {line}\n" for i, line in enumerate(source.splitlines(), start=1)
    )
    commented = "".join(f"// {line}\n" for line in header.splitlines())
    text = f"{commented}\n{numbered}"
    for directory in (cache_dir() / "failed", Path(tempfile.gettempdir()) / "attnlang-failed"):
        try:
            directory.mkdir(parents=True, exist_ok=True)
            path = directory / f"{key}.cu"
            path.write_text(text)
            return path
        except OSError:
            continue
    raise OSError("could not write the failed source anywhere")


def list_entries() -> list[dict[str, Any]]:
    """The disk entries, oldest first: dicts with key, label, arch, size, mtime, path.

    Reads only each entry's header and metadata (no checksum); label and arch are None for
    an entry whose header does not parse.
    """
    directory = cache_dir()
    if not directory.is_dir():
        return []
    rows = []
    for path in directory.glob("*.cubin"):
        try:
            stat = path.stat()
        except OSError:
            continue  # removed while we listed
        meta: dict[str, Any] = {}
        try:
            with path.open("rb") as f:
                magic, _, meta_len, _, _ = _HEADER.unpack(f.read(_HEADER.size))
                if magic == _MAGIC:
                    meta = json.loads(f.read(meta_len))
        except (OSError, ValueError, struct.error):
            pass
        rows.append({
            "key": path.stem, "label": meta.get("label"), "arch": meta.get("arch"),
            "size": stat.st_size, "mtime": stat.st_mtime, "path": path,
        })
    rows.sort(key=lambda r: (r["mtime"], r["key"]))
    return rows


def clear_cache() -> int:
    """Remove every disk entry (with lock files, temp files, failed dumps and the toolchain
    memo) and empty the in-process cache; returns the number of entries removed."""
    clear_memory_cache()
    directory = cache_dir()
    if not directory.is_dir():
        return 0
    removed = 0
    for pattern in ("*.cubin", "*.lock", ".*.tmp", "failed/*.cu", "toolchain/memo.json"):
        for path in directory.glob(pattern):
            try:
                path.unlink()
            except OSError:
                continue
            removed += pattern == "*.cubin"
    for sub in ("failed", "toolchain"):
        with contextlib.suppress(OSError):
            (directory / sub).rmdir()
    return removed


# The in-process cache, in front of the disk: key -> whatever the compiler stores (a Cubin).
_memory: dict[str, Any] = {}


def memory_get(key: str) -> Any | None:
    """The in-process entry for `key`, or None."""
    return _memory.get(key)


def memory_put(key: str, value: Any) -> None:
    """Remember `value` under `key` for the rest of the process."""
    _memory[key] = value


def clear_memory_cache() -> None:
    """Forget every in-process entry (tests call this to start cold)."""
    _memory.clear()
