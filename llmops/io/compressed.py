"""Compressed data files (`.gz`, `.bz2`, `.xz`, `.zst`): which a file is, what it holds, and its bytes
decompressed."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma
import zlib
from pathlib import Path
from typing import IO, Any

# the bytes a decompressed file is read in
DECOMPRESS_BLOCK = 1 << 20

# compressed files, by their last suffix: read whole (a compressed stream cannot be cut by bytes), decompressed as
# they are read
COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".xz": "xz", ".zst": "zstd"}


# what a decompressor raises on bytes it cannot decompress (gzip's BadGzipFile is an OSError, pyarrow's errors are
# OSError or ValueError), or at a stream that ends too soon
DECOMPRESSION_ERRORS = (OSError, EOFError, ValueError, zlib.error, lzma.LZMAError)


def compression(path: Path) -> str | None:
    return COMPRESSIONS.get(path.suffix.lower())


def data_suffix(path: Path) -> str:
    """The suffix that says what a file holds: `.jsonl` for `part-0.jsonl.gz`."""
    return (path.with_suffix("") if compression(path) else path).suffix.lower()


def open_compressed(path: Path, codec: str) -> IO[bytes]:
    if codec == "zstd":  # pyarrow's codec: no extra package for the one format the standard library lacks
        import pyarrow as pa

        return io.BufferedReader(pa.CompressedInputStream(pa.OSFile(str(path)), "zstd"), DECOMPRESS_BLOCK)  # type: ignore[arg-type]
    if codec == "gzip":  # gzip's own reader refuses bytes after a stream that start no other
        return gzip.open(path, "rb")  # type: ignore[return-value]
    return io.BufferedReader(Streams(path, bz2.BZ2Decompressor if codec == "bz2" else lzma.LZMADecompressor,
                                     padded=codec == "xz"), DECOMPRESS_BLOCK)


class Streams(io.RawIOBase):
    """A file of compressed streams one after the other, decompressed in order. The standard library's bz2 and xz
    readers stop without a word at bytes after a stream that do not decode as another (a damaged second stream,
    rows appended uncompressed), losing them; here they raise, as gzip's reader does. An xz file may pad its streams
    with NUL bytes, which are skipped."""

    def __init__(self, path: Path, decompressor: Any, padded: bool) -> None:
        super().__init__()
        self.handle, self.new, self.padded = path.open("rb"), decompressor, padded
        self.decompressor = decompressor()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while True:
            if self.decompressor.eof:
                rest = self.next_stream(self.decompressor.unused_data)
                if not rest:
                    return 0
                self.decompressor = self.new()
            elif self.decompressor.needs_input:
                rest = self.handle.read(DECOMPRESS_BLOCK)
                if not rest:
                    raise EOFError("the compressed file ends inside a stream")
            else:  # output of the input given before is still to come
                rest = b""
            data = self.decompressor.decompress(rest, len(buffer))
            if data:
                buffer[:len(data)] = data
                return len(data)

    def next_stream(self, unused: bytes) -> bytes:
        """The start of the next stream after one that ended (with the bytes read past it); empty at the file's end."""
        rest = unused or self.handle.read(DECOMPRESS_BLOCK)
        while self.padded and rest and not rest.lstrip(b"\0"):
            rest = self.handle.read(DECOMPRESS_BLOCK)
        return rest.lstrip(b"\0") if self.padded else rest

    def close(self) -> None:
        self.handle.close()
        super().close()
