"""A Hugging Face Hub on 127.0.0.1 for the tests: it serves model repositories of real files the way the Hub does
for `huggingface_hub` (HF_ENDPOINT pointed at it), with only the routes huggingface_hub's downloads call:

- GET /api/models/ORG/NAME[/revision/REV]: the repo's info (id, sha: the commit, siblings);
- GET /api/models/ORG/NAME/tree/REV[/PATH]: its files (type, path, size, oid), one page;
- HEAD and GET /ORG/NAME/resolve/REV/FILE: the file, with X-Repo-Commit, ETag, Content-Length, Accept-Ranges;
  a Range request gets 206 and Content-Range.

An unknown repo is a 404 with X-Error-Code RepoNotFound, an unknown revision RevisionNotFound, an unknown file
EntryNotFound. `requests` records each request (method, path, Range, Authorization); `cut_once` maps a file to a
byte count at which its next whole-file GET is cut off, as a dropped connection leaves it, so that the client must
resume it."""

from __future__ import annotations

import hashlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

COMMIT = "0123456789abcdef0123456789abcdef01234567"


class Hub:
    def __init__(self) -> None:
        self.repos: dict[str, dict[str, Path]] = {}
        self.requests: list[tuple[str, str, str | None, str | None]] = []  # method, path, Range, Authorization
        self.cut_once: dict[str, int] = {}
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def add(self, repo_id: str, folder: Path, files: list[str] | None = None) -> None:
        """Serve the files of `folder` (all, or those named) as the repository `repo_id`."""
        names = files if files is not None else sorted(p.name for p in folder.iterdir() if p.is_file())
        self.repos[repo_id] = {n: folder / n for n in names}

    def __enter__(self) -> Hub:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


def oid(path: Path) -> str:
    """The file's git-style id, which the Hub sends as its ETag."""
    return hashlib.sha1(path.read_bytes()).hexdigest()


def _handler(hub: Hub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802
            self._serve(body=True)

        def do_HEAD(self) -> None:  # noqa: N802
            self._serve(body=False)

        def _error(self, code: int, error: str) -> None:
            data = json.dumps({"error": error}).encode()
            self.send_response(code)
            self.send_header("X-Error-Code", error)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(data)

        def _json(self, value: object) -> None:
            data = json.dumps(value).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _serve(self, body: bool) -> None:
            path = unquote(urlsplit(self.path).path)
            hub.requests.append((self.command, path, self.headers.get("Range"), self.headers.get("Authorization")))
            parts = path.strip("/").split("/")
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                return self._api(parts[2] + "/" + parts[3], parts[4:])
            if len(parts) >= 5 and parts[2] == "resolve":
                return self._file(parts[0] + "/" + parts[1], parts[3], "/".join(parts[4:]), body)
            self._error(404, "RepoNotFound")

        def _api(self, repo_id: str, rest: list[str]) -> None:
            files = hub.repos.get(repo_id)
            if files is None:
                return self._error(404, "RepoNotFound")
            if rest[:1] in ([], ["revision"]):
                if rest and rest[1] not in ("main", COMMIT):
                    return self._error(404, "RevisionNotFound")
                return self._json({"id": repo_id, "sha": COMMIT, "private": False,
                                   "siblings": [{"rfilename": n} for n in files]})
            if rest[:1] == ["tree"] and len(rest) >= 2:
                if rest[1] not in ("main", COMMIT):
                    return self._error(404, "RevisionNotFound")
                return self._json([{"type": "file", "path": n, "size": p.stat().st_size, "oid": oid(p)}
                                   for n, p in files.items()])
            self._error(404, "RepoNotFound")

        def _file(self, repo_id: str, revision: str, name: str, body: bool) -> None:
            files = hub.repos.get(repo_id)
            if files is None:
                return self._error(404, "RepoNotFound")
            if revision not in ("main", COMMIT):
                return self._error(404, "RevisionNotFound")
            if name not in files:
                return self._error(404, "EntryNotFound")
            data = files[name].read_bytes()
            start, end = 0, len(data)
            ranged = self.headers.get("Range")
            if ranged and ranged.startswith("bytes="):
                lo, _, hi = ranged[6:].partition("-")
                start, end = int(lo or 0), (int(hi) + 1 if hi else len(data))
            self.send_response(206 if ranged else 200)
            self.send_header("X-Repo-Commit", COMMIT)
            self.send_header("ETag", f'"{oid(files[name])}"')
            self.send_header("Accept-Ranges", "bytes")
            self.send_header("Content-Length", str(end - start))
            if ranged:
                self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
            self.end_headers()
            if not body:
                return
            cut = hub.cut_once.pop(name, None) if not ranged else None
            if cut is not None:
                self.wfile.write(data[:cut])
                self.wfile.flush()
                self.close_connection = True
                return
            self.wfile.write(data[start:end])

    return Handler
