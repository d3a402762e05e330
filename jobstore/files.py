"""Files of the Batch API, kept in Postgres in chunks (file_chunks), so that a file goes in and comes out a
chunk at a time: an upload of 200 MB never sits whole in an API process's memory, nor does an output file
being written or downloaded. The caller owns the transaction (nothing here commits)."""

from __future__ import annotations

import secrets
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from sqlalchemy import delete, func, insert, select, tuple_
from sqlalchemy.orm import Session

from jobstore.models import File, FileChunk

CHUNK_BYTES = 1 << 20  # a chunk row holds about this much


class FileLimitExceeded(ValueError):
    """An upload over a size or line limit; the message names the limit."""


def new_file_id() -> str:
    return "file-" + secrets.token_hex(12)


@dataclass
class FileLimits:
    max_bytes: int
    max_lines: int


class FileWriter:
    """Writes one file's content in chunks as it comes, counting bytes and non-blank lines; `close()`
    records the file's row. Limits (optional) are checked as the bytes arrive."""

    def __init__(
        self,
        db: Session,
        tenant_id: uuid.UUID,
        purpose: str,
        filename: str,
        limits: FileLimits | None = None,
        file_id: str | None = None,
    ):
        self.db, self.limits = db, limits
        self.file = File(
            id=file_id or new_file_id(),
            tenant_id=tenant_id,
            purpose=purpose,
            filename=filename,
            bytes=0,
            lines=0,
        )
        db.add(self.file)
        db.flush()  # the row first: chunks refer to it
        self._buffer = bytearray()
        self._seq = 0
        self._line_counted = False  # the line being written has content, and was counted

    def write(self, data: bytes) -> None:
        if not data:
            return
        self.file.bytes += len(data)
        if self.limits and self.file.bytes > self.limits.max_bytes:
            raise FileLimitExceeded(
                f"file: larger than {self.limits.max_bytes:,} bytes, the most a batch input file may hold"
            )
        self._count_lines(data)
        self._buffer += data
        while len(self._buffer) >= CHUNK_BYTES:
            self._flush(bytes(self._buffer[:CHUNK_BYTES]))
            del self._buffer[:CHUNK_BYTES]

    def close(self) -> File:
        if self._buffer:
            self._flush(bytes(self._buffer))
            self._buffer.clear()
        self.db.flush()
        return self.file

    def _count_lines(self, data: bytes) -> None:
        """Non-blank lines: a line counts once, when its first non-space byte arrives."""
        lines, counted = 0, self._line_counted  # locals: the ORM attribute costs ~1 us a set
        for i, segment in enumerate(data.split(b"\n")):
            if i:
                counted = False  # a newline began a new line
            if not counted and segment.strip():
                lines += 1
                counted = True
        self.file.lines += lines
        self._line_counted = counted
        if self.limits and self.file.lines > self.limits.max_lines:
            raise FileLimitExceeded(
                f"file: more than {self.limits.max_lines:,} requests (lines), the most a batch may hold"
            )

    def _flush(self, chunk: bytes) -> None:
        self.db.execute(insert(FileChunk), [{"file_id": self.file.id, "seq": self._seq, "data": chunk}])
        self._seq += 1


def store_file(
    db: Session,
    tenant_id: uuid.UUID,
    purpose: str,
    filename: str,
    pieces: Iterable[bytes],
    limits: FileLimits | None = None,
) -> File:
    """Write a file from `pieces` of its content; FileLimitExceeded when it breaks `limits`."""
    writer = FileWriter(db, tenant_id, purpose, filename, limits)
    for piece in pieces:
        writer.write(piece)
    return writer.close()


def get_file(db: Session, file_id: str, tenant_id: uuid.UUID) -> File | None:
    """The tenant's file, or None (another tenant's file is indistinguishable from a missing one)."""
    return db.scalar(select(File).where(File.id == file_id, File.tenant_id == tenant_id))


def list_files(
    db: Session,
    tenant_id: uuid.UUID,
    *,
    purpose: str | None = None,
    after: str | None = None,
    limit: int,
    newest_first: bool = True,
) -> list[File]:
    """The tenant's files (of `purpose`, if given) in creation order, newest first unless told, starting
    after the file `after` (keyset on (created_at, id): a page never skips or repeats a file)."""
    stmt = select(File).where(File.tenant_id == tenant_id)
    if purpose is not None:
        stmt = stmt.where(File.purpose == purpose)
    key = tuple_(File.created_at, File.id)
    if after is not None:
        anchor = select(File.created_at, File.id).where(File.id == after, File.tenant_id == tenant_id)
        position = db.execute(anchor).one_or_none()
        if position is None:
            return []
        stmt = stmt.where(key < tuple_(*position) if newest_first else key > tuple_(*position))
    order = (File.created_at.desc(), File.id.desc()) if newest_first else (File.created_at, File.id)
    return list(db.scalars(stmt.order_by(*order).limit(limit)))


def delete_file(db: Session, file_id: str, tenant_id: uuid.UUID) -> bool:
    """Delete the tenant's file and its chunks; False if there was none."""
    return db.execute(delete(File).where(File.id == file_id, File.tenant_id == tenant_id)).rowcount == 1


def chunk_count(db: Session, file_id: str) -> int:
    return db.scalar(select(func.count()).select_from(FileChunk).where(FileChunk.file_id == file_id))


def iter_chunks(db: Session, file_id: str) -> Iterator[bytes]:
    """The file's content a chunk at a time (one query per chunk: one chunk in memory at once)."""
    seq = 0
    while True:
        data = db.scalar(select(FileChunk.data).where(FileChunk.file_id == file_id, FileChunk.seq == seq))
        if data is None:
            return
        yield bytes(data)
        seq += 1


def iter_lines(chunks: Iterable[bytes]) -> Iterator[tuple[int, bytes]]:
    """(line number from 1, line) for each non-blank line of the content, without its end of line."""
    number, carry = 0, b""
    for chunk in chunks:
        lines = (carry + chunk).split(b"\n")
        carry = lines.pop()
        for line in lines:
            number += 1
            if line.strip():
                yield number, line.rstrip(b"\r")
    if carry.strip():
        yield number + 1, carry.rstrip(b"\r")
