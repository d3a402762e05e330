"""/v1/files: the Batch API's files (OpenAI's paths and shapes): upload a batch input file, list the
caller's files, read one, its content, delete it. An upload streams into Postgres a chunk at a time (jobstore/files.py)."""

from __future__ import annotations

import re
from typing import Literal

from flask import Blueprint, Response, request, stream_with_context
from pydantic import BaseModel, Field
from werkzeug.exceptions import RequestEntityTooLarge

from jobstore import files
from jobstore.files import CHUNK_BYTES, FileLimitExceeded, FileLimits
from webapi.auth import current_tenant, require_api_key
from webapi.errors import APIError
from webapi.extensions import db, services
from webapi.openai_schemas import FileDeleted, FileListQuery, FileObject, FilePage
from webapi.spec import endpoint

bp = Blueprint("files", __name__, url_prefix="/v1/files")
bp.before_request(require_api_key)
MULTIPART_OVERHEAD = 1 << 16  # the form's boundaries and headers around the file
OBJECT_ID = re.compile(r"[A-Za-z0-9_-]{1,40}")  # the shape of the ids genq gives out (file-..., batch_...)


class FileUpload(BaseModel):
    """Body of POST /v1/files (multipart/form-data)."""

    purpose: Literal["batch"] = Field(description="Only batch input files are uploaded.")
    file: bytes = Field(description="A JSONL file: one request per line.")


@bp.post("")
@endpoint(form=FileUpload, responses={200: FileObject})
def upload_file():
    """Upload a batch input file (JSONL, at most MAX_BATCH_REQUESTS lines and MAX_FILE_BYTES bytes)."""
    settings = services().settings
    request.max_content_length = settings.max_file_bytes + MULTIPART_OVERHEAD
    try:
        purpose, upload = request.form.get("purpose"), request.files.get("file")
    except RequestEntityTooLarge:
        raise APIError(
            413, "file_too_large", f"file: larger than {settings.max_file_bytes:,} bytes, the most allowed"
        ) from None
    if purpose != "batch":
        raise APIError(400, "invalid_request", "purpose: give `batch` (the only purpose genq serves)")
    if upload is None:
        raise APIError(400, "invalid_request", "file: send the file as the multipart field `file`")
    limits = FileLimits(settings.max_file_bytes, settings.max_batch_requests)
    name = "".join(ch for ch in upload.filename or "" if ch.isprintable())[:255] or "input.jsonl"
    try:
        with services().sessions.begin() as session:
            stored = files.store_file(
                session,
                current_tenant().id,
                "batch",
                name,
                iter(lambda: upload.stream.read(CHUNK_BYTES), b""),
                limits,
            )
    except FileLimitExceeded as exc:
        raise APIError(
            400, "file_too_large" if "bytes" in str(exc) else "too_many_batch_requests", str(exc)
        ) from None
    return FileObject.of(stored).model_dump()


@bp.get("")
@endpoint(query=FileListQuery, responses={200: FilePage})
def list_files(query: FileListQuery):
    """The caller's files (uploaded inputs, and batches' output and error files), newest first by default."""
    if query.after is not None and not OBJECT_ID.fullmatch(query.after):
        raise APIError(422, "invalid_request", "after: not a file id")
    page = files.list_files(
        db(),
        current_tenant().id,
        purpose=query.purpose,
        after=query.after,
        limit=query.limit + 1,
        newest_first=query.order == "desc",
    )
    return FilePage.of(page, query.limit, FileObject.of).model_dump()


@bp.get("/<file_id>")
@endpoint(responses={200: FileObject})
def get_file(file_id: str):
    """A file's description: its size, name and purpose."""
    return FileObject.of(owned_file(file_id)).model_dump()


@bp.get("/<file_id>/content")
@endpoint(responses={200: None})
def file_content(file_id: str):
    """A file's content, streamed a chunk at a time."""
    file = owned_file(file_id)
    sessions = services().sessions

    def chunks():
        with sessions() as session:
            yield from files.iter_chunks(session, file.id)

    return Response(
        stream_with_context(chunks()),
        mimetype="application/octet-stream",
        headers={
            "Content-Length": str(file.bytes),
            "Content-Disposition": f'attachment; filename="{file.id}.jsonl"',
        },
    )


@bp.delete("/<file_id>")
@endpoint(responses={200: FileDeleted})
def delete_file(file_id: str):
    """Delete a file (a batch made from it keeps running)."""
    deleted = files.delete_file(db(), owned_file(file_id).id, current_tenant().id)
    db().commit()
    return FileDeleted(id=file_id, deleted=deleted).model_dump()


def owned_file(file_id: str):
    """404 for a file that does not exist or belongs to another tenant (indistinguishable on purpose)."""
    file = files.get_file(db(), file_id, current_tenant().id) if OBJECT_ID.fullmatch(file_id) else None
    if file is None:
        raise APIError(404, "not_found", f"no such file: {file_id}")
    return file
