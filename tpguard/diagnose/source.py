"""Source: a trace file's bytes as a buffered binary stream, plain or compressed.

Rotated traces are often compressed (logrotate's gzip or zstd). The compression is told by the
file's first bytes, not its name. zstd comes from the standard library where Python has it
(`compression.zstd`, 3.14+), else from the `zstandard` package if installed; it is never required.

Decompression runs through decompressor objects, one per gzip member / zstd frame, so a stream
cut short (a rotation killed mid-compression, a full disk) still yields every line before the
cut; the reader then treats the last, unfinished line like any torn last line.
"""

from __future__ import annotations

import io
import os
import zlib
from pathlib import Path

from tpguard.errors import TraceError

GZIP_MAGIC = b"\x1f\x8b"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
# Formats recognised only to say what the problem is.
UNSUPPORTED_MAGIC = {b"BZh": "bzip2", b"\xfd7zXZ\x00": "xz", b"PK\x03\x04": "zip", b"\x04\x22\x4d\x18": "lz4"}
COMPRESSED_CHUNK = 1 << 18
BUFFER = 1 << 20


def compression_of(path: Path) -> str | None:
    """'gzip', 'zstd' or None (plain) from the first bytes; TraceError for formats not read."""
    try:
        with open(path, "rb") as f:
            head = f.read(6)
    except OSError as e:
        raise TraceError(f"{path}: cannot open ({e.strerror})") from None
    if head.startswith(GZIP_MAGIC):
        return "gzip"
    if head.startswith(ZSTD_MAGIC):
        return "zstd"
    for magic, name in UNSUPPORTED_MAGIC.items():
        if head.startswith(magic):
            raise TraceError(f"{path}: compressed with {name}, which tpguard does not read "
                             "(gzip and zstd it does); decompress it first")
    return None


def _zstd_decompressor():
    """A factory of zstd decompressor objects and the error type they raise, or None."""
    try:
        from compression import zstd  # Python 3.14+

        return zstd.ZstdDecompressor, zstd.ZstdError
    except ImportError:
        pass
    try:
        import zstandard
    except ImportError:
        return None
    return (lambda: zstandard.ZstdDecompressor().decompressobj()), zstandard.ZstdError


class _Decompressing(io.RawIOBase):
    """The decompressed bytes of a gzip (multi-member) or zstd (multi-frame) file."""

    def __init__(self, path: Path, kind: str):
        if kind == "gzip":
            self._new, self._errors = (lambda: zlib.decompressobj(wbits=31)), (zlib.error, EOFError)
        else:
            found = _zstd_decompressor()
            if found is None:
                raise TraceError(f"{path}: compressed with zstd, and this Python has no zstd support "
                                 "(Python 3.14+, or `pip install zstandard`); or decompress it first")
            self._new, error = found
            self._errors = (error, EOFError)
        self.path, self.kind = path, kind
        self.truncated = False  # the compressed data ended inside a member / frame
        self._f = open(path, "rb")
        self._d = self._new()
        self._out = memoryview(b"")

    def readable(self) -> bool:
        return True

    def _more(self) -> bytes | None:
        """The next decompressed piece, or None at the end of the file."""
        while True:
            if self._d.eof:  # a member / frame ended: the rest, if any, starts another
                rest = self._d.unused_data or self._f.read(COMPRESSED_CHUNK)
                if not rest.strip(b"\0"):  # the end (gzip allows zero padding after the last member)
                    return None
                self._d = self._new()
                data = self._d.decompress(rest)
            else:
                chunk = self._f.read(COMPRESSED_CHUNK)
                if not chunk:
                    self.truncated = True
                    return None
                data = self._d.decompress(chunk)
            if data:
                return data

    def readinto(self, b) -> int:
        if not self._out:
            try:
                piece = self._more()
            except self._errors as e:
                raise TraceError(f"{self.path}: corrupt {self.kind} data ({e})") from None
            if piece is None:
                return 0
            self._out = memoryview(piece)
        n = min(len(b), len(self._out))
        b[:n] = self._out[:n]
        self._out = self._out[n:]
        return n

    def close(self) -> None:
        if not self.closed:
            self._f.close()
        super().close()


def open_trace_bytes(path: str | os.PathLike) -> io.BufferedIOBase:
    """A buffered binary stream of the file's (decompressed) bytes; TraceError if unreadable.

    `truncated(stream)` says afterwards whether compressed data ended early."""
    p = Path(path)
    kind = compression_of(p)
    if kind is None:
        try:
            return open(p, "rb")
        except OSError as e:
            raise TraceError(f"{p}: cannot open ({e.strerror})") from None
    try:
        return io.BufferedReader(_Decompressing(p, kind), buffer_size=BUFFER)
    except OSError as e:
        raise TraceError(f"{p}: cannot open ({e.strerror})") from None


def truncated(stream: io.BufferedIOBase) -> bool:
    raw = getattr(stream, "raw", None)
    return bool(getattr(raw, "truncated", False))
