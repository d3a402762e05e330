"""What a genq-batch run keeps on disk: the state file (its run id, and custom_id -> job id of every
accepted submission, appended and fsynced before anything else happens) and the results file (a line per
request as it ends; rewritten in input order at the end)."""

from __future__ import annotations

import json
import os
import secrets
import threading
from pathlib import Path

RUN_ID_BYTES = 8


class State:
    """The run's state file. Its first line is `{"run_id": ...}`: the run's Idempotency-Keys are
    `<run id>:<custom_id>`, so two files (or two runs of one file with another state file) never collide.
    A state file written before run ids existed has none, and its keys stay the bare custom_ids."""

    def __init__(self, path: Path):
        self.path = path
        self.entries: dict[str, dict] = {}
        self.run_id: str | None = None
        fresh = not path.exists() or path.stat().st_size == 0
        if not fresh:
            for n, line in enumerate(path.read_text().splitlines()):
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:  # a line cut short by a crash
                    continue
                if n == 0 and "run_id" in entry:
                    self.run_id = entry["run_id"]
                elif "custom_id" in entry:
                    self.entries[entry["custom_id"]] = entry
        self._lock = threading.Lock()
        self._file = path.open("a")
        if fresh:
            self.run_id = secrets.token_hex(RUN_ID_BYTES)
            self._append([{"run_id": self.run_id}])

    def idempotency_key(self, custom_id: str) -> str:
        if self.run_id is None:
            return custom_id
        key = f"{self.run_id}:{custom_id}"
        return key if len(key) <= 255 and key.isprintable() else f"{self.run_id}:#{_digest(custom_id)}"

    def record(self, entries: list[dict]) -> None:
        """Append entries ({custom_id, job_id, created_at} or {custom_id, job_id: null, error}), fsynced."""
        with self._lock:
            self._append(entries)
            for entry in entries:
                self.entries[entry["custom_id"]] = entry

    def _append(self, entries: list[dict]) -> None:
        self._file.write("".join(json.dumps(entry) + "\n" for entry in entries))
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def _digest(text: str) -> str:
    import hashlib

    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


class Results:
    """The results file: each row appended (and flushed) as its request ends; rows found there when a run
    resumes are done. `finish` rewrites the file in input order, atomically."""

    def __init__(self, path: Path):
        self.path = path
        self.rows: dict[str, dict] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    continue
                self.rows[row["custom_id"]] = row
        self._file = path.open("a")

    def write(self, row: dict) -> None:
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        self.rows[row["custom_id"]] = row

    def finish(self, order: list[str]) -> None:
        self._file.close()
        tmp = self.path.with_name(self.path.name + ".tmp")
        with tmp.open("w") as f:
            for custom_id in order:
                f.write(json.dumps(self.rows[custom_id]) + "\n")
        tmp.replace(self.path)

    def close(self) -> None:
        self._file.close()
