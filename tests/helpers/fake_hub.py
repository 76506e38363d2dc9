"""A local stand-in for the part of the Hugging Face hub API that huggingface_hub uses to
pull a model: model info (sha, file list), and resolve (HEAD and GET, with ETag, the commit
header and byte ranges). Started by tests on 127.0.0.1; HF_ENDPOINT points at it.

Repositories hold commits (the last is `main`); a repository can be gated (needs a token),
and a file can be set to break off near its end on its first download."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote


@dataclass
class FakeRepo:
    commits: list[tuple[str, dict[str, bytes]]]  # (sha, files), oldest first; the last is main
    gated: bool = False

    def files_at(self, revision: str) -> tuple[str, dict[str, bytes]] | None:
        if revision == "main":
            return self.commits[-1]
        return next(((sha, f) for sha, f in self.commits if sha == revision or sha.startswith(revision)), None)


@dataclass
class FakeHub:
    repos: dict[str, FakeRepo] = field(default_factory=dict)
    interrupt_once: set[str] = field(default_factory=set)  # file names that break off once
    log: list[tuple[str, str, str]] = field(default_factory=list)  # (method, path, Range header)
    url: str = ""

    def start(self) -> FakeHub:
        hub = self

        class Handler(_Handler):
            pass

        Handler.hub = hub
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


_INFO = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/revision/([^/?]+))?/?(?:\?.*)?$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


class _Handler(BaseHTTPRequestHandler):
    hub: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, *args) -> None:  # quiet
        pass

    def _error(self, status: int, code: str) -> None:
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("Content-Type", "application/json")
        body = json.dumps({"error": code}).encode()
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _repo(self, repo_id: str, revision: str):
        repo = self.hub.repos.get(repo_id)
        if repo is None:
            return self._error(404, "RepoNotFound")
        if repo.gated and not self.headers.get("Authorization"):
            return self._error(401, "GatedRepo")
        found = repo.files_at(unquote(revision))
        if found is None:
            return self._error(404, "RevisionNotFound")
        return found

    def do_GET(self) -> None:
        self.hub.log.append((self.command, self.path, self.headers.get("Range", "")))
        if m := _INFO.match(self.path):
            found = self._repo(m.group(1), m.group(2) or "main")
            if found:
                sha, files = found
                body = json.dumps(
                    {"id": m.group(1), "modelId": m.group(1), "sha": sha, "private": False, "gated": False,
                     "siblings": [{"rfilename": n} for n in files]}
                ).encode()  # fmt: skip
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            return
        if m := _RESOLVE.match(self.path.split("?")[0]):
            return self._resolve(m.group(1), m.group(2), unquote(m.group(3)))
        self._error(404, "EntryNotFound")

    do_HEAD = do_GET

    def _resolve(self, repo_id: str, revision: str, name: str) -> None:
        found = self._repo(repo_id, revision)
        if not found:
            return
        sha, files = found
        if name not in files:
            return self._error(404, "EntryNotFound")
        data = files[name]
        start = 0
        if m := re.match(r"bytes=(\d+)-", self.headers.get("Range", "")):
            start = int(m.group(1))
        self.send_response(206 if start else 200)
        self.send_header("X-Repo-Commit", sha)
        self.send_header("ETag", '"' + hashlib.sha256(data).hexdigest() + '"')
        self.send_header("Content-Length", str(len(data) - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        if self.command == "HEAD":
            return
        if name in self.hub.interrupt_once and not start:
            self.hub.interrupt_once.discard(name)
            # Break off after all but the last MiB (past huggingface_hub's 10 MB read chunk).
            self.wfile.write(data[: max(len(data) - (1 << 20), len(data) // 2)])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)
            return
        self.wfile.write(data[start:])


TINY_MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def tiny_model_hub(tiny_dir: Path) -> FakeHub:
    """A started stand-in for the hub serving the tiny model folder as org/tiny-mlx."""
    files = {name: (tiny_dir / name).read_bytes() for name in TINY_MODEL_FILES}
    hub = FakeHub(repos={"org/tiny-mlx": FakeRepo([("1" * 40, files)])})
    hub.start()
    return hub


@contextlib.contextmanager
def hub_environment(hub: FakeHub, root: Path):
    """HF_* pointing at `hub` (a gateway started inside reads them), restored on leaving."""
    env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(root / "hf"), "HF_TOKEN": "", "HF_HUB_DISABLE_TELEMETRY": "1"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
