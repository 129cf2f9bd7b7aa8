"""A loopback stand-in for the Hugging Face Hub's HTTP file API, for tests that download for real.

`FakeHub({"org/name": folder})` serves each local folder as a model repo on http://127.0.0.1:PORT; point
`HF_ENDPOINT` at `hub.url` (before `huggingface_hub` is imported: it reads the variable at import time) and
`snapshot_download`, `hf_hub_download` and `HfApi().list_repo_files` run their normal code paths without network.

Requests answered, as huggingface_hub 2.x sends them (model repos only; `rev` is "main" or the repo's fake commit
`hub.sha(repo_id)`, percent-encoded segments are decoded):

- `GET /api/models/{repo_id}[/revision/{rev}]`: repo info JSON (`id`, `sha`, `siblings`, `gated`, ...), as used
  by `repo_info`/`model_info` (`snapshot_download` calls it to turn "main" into a commit).
- `GET /api/models/{repo_id}/tree/{rev}[/{path}]?recursive=true|false[&cursor=N]`: tree entries `{type, oid, size,
  path}` ("file" or "directory"), `page_size` per page with a GitHub-style `Link: <...>; rel="next"` header, as
  followed by `list_repo_tree`/`list_repo_files`.
- `HEAD|GET /{repo_id}/resolve/{rev}/{path}`: the file itself (no redirect), with `X-Repo-Commit`, `ETag` (the git
  blob sha1, quoted), `Content-Length`; `Range: bytes=N-` (sent only when resuming) gets a 206.
- `GET /api/agent-harnesses`: an empty registry (huggingface_hub fetches it once a day per HF_HOME, best effort).

Errors mimic the hub's `X-Error-Code` headers, so huggingface_hub raises its typed errors: unknown repo 404
`RepoNotFound`; a repo in `gated` without `Authorization: Bearer <token>` 401 `GatedRepo` (a wrong token 403);
unknown revision 404 `RevisionNotFound`; unknown file 404 `EntryNotFound` (with `X-Repo-Commit`, as the hub sends).

No Xet headers (`X-Xet-*`) or `xetHash` fields are ever sent, so files come over plain HTTP. Every request is
recorded in `hub.requests` as "METHOD /raw/path?query" in arrival order.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit


class _HubError(Exception):
    def __init__(self, status: int, code: str, message: str, commit: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.commit = status, code, message, commit


def _blob_oid(data: bytes) -> str:
    """The git blob id the hub reports as `oid` (and ETag) for a non-LFS file."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    """Serves {repo_id: local folder} on http://127.0.0.1:PORT as the hub would."""

    page_size = 1000  # the hub's tree page size; lower it in a test to exercise pagination
    stall_trees = False  # tree listings accepted and never answered (a hub or proxy stalling mid-download)

    def __init__(self, repos: dict[str, Path], gated: set[str] = frozenset(), token: str | None = None):
        self.repos = {repo_id: Path(folder) for repo_id, folder in repos.items()}
        self.gated = set(gated)
        self.token = token
        self.requests: list[str] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread: threading.Thread | None = None

    @staticmethod
    def sha(repo_id: str) -> str:
        """The fixed fake commit that "main" of `repo_id` resolves to."""
        return hashlib.sha1(f"fakehub:{repo_id}".encode()).hexdigest()

    def __enter__(self) -> FakeHub:
        self._thread = threading.Thread(target=self._server.serve_forever, name="fakehub", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stall_trees = False
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join()

    # -- repo model --------------------------------------------------------------------------------------------------

    def _files(self, repo_id: str) -> list[str]:
        root = self.repos[repo_id]
        return sorted(
            p.relative_to(root).as_posix()
            for p in root.rglob("*")
            if p.is_file() and ".git" not in p.relative_to(root).parts
        )

    def _check(self, repo_id: str, rev: str | None, auth: str | None) -> str:
        """Repo, access and revision checks in the hub's order; returns the commit sha."""
        if repo_id not in self.repos:
            raise _HubError(404, "RepoNotFound", "Repository not found")
        if repo_id in self.gated and (self.token is None or auth != f"Bearer {self.token}"):
            status = 401 if auth is None else 403
            raise _HubError(
                status,
                "GatedRepo",
                f"Access to model {repo_id} is restricted. You must have access to "
                "it and be authenticated to access it. Please log in.",
            )
        sha = self.sha(repo_id)
        if rev not in (None, "main", sha):
            raise _HubError(404, "RevisionNotFound", "Invalid rev id: " + str(rev))
        return sha

    def _info(self, repo_id: str, sha: str) -> dict:
        return {
            "_id": sha[:24],
            "id": repo_id,
            "modelId": repo_id,
            "author": repo_id.partition("/")[0],
            "sha": sha,
            "private": False,
            "gated": "manual" if repo_id in self.gated else False,
            "disabled": False,
            "lastModified": "2024-01-01T00:00:00.000Z",
            "createdAt": "2024-01-01T00:00:00.000Z",
            "tags": [],
            "siblings": [{"rfilename": f} for f in self._files(repo_id)],
        }

    def _tree(self, repo_id: str, sub: str, recursive: bool) -> list[dict]:
        root, entries = self.repos[repo_id], []
        prefix = sub.strip("/") + "/" if sub.strip("/") else ""
        if prefix and not (root / prefix).is_dir():
            raise _HubError(404, "EntryNotFound", f"{sub} does not exist on main", self.sha(repo_id))
        dirs: set[str] = set()
        for f in self._files(repo_id):
            if not f.startswith(prefix):
                continue
            parts = f[len(prefix) :].split("/")
            for depth in range(1, len(parts) if recursive else min(2, len(parts))):
                dirs.add(prefix + "/".join(parts[:depth]))
            if recursive or len(parts) == 1:
                data = (root / f).read_bytes()
                entries.append({"type": "file", "oid": _blob_oid(data), "size": len(data), "path": f})
        entries += [
            {"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "size": 0, "path": d} for d in dirs
        ]
        return sorted(entries, key=lambda e: e["path"])

    def _file(self, repo_id: str, path: str, sha: str) -> bytes:
        root = self.repos[repo_id].resolve()
        target = (root / path).resolve()
        if not path or not target.is_file() or root not in target.parents or ".git" in Path(path).parts:
            raise _HubError(404, "EntryNotFound", f"{path} does not exist on main", sha)
        return target.read_bytes()

    # -- HTTP --------------------------------------------------------------------------------------------------------

    def _split_repo(self, segs: list[str]) -> tuple[str, list[str]]:
        """(repo_id, rest) from path segments: a known one-segment id ("gpt2") or else "org/name"."""
        if segs and segs[0] in self.repos:
            return segs[0], segs[1:]
        return "/".join(segs[:2]), segs[2:]

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # keep test output quiet
                pass

            def do_HEAD(self) -> None:
                self._serve(body=False)

            def do_GET(self) -> None:
                self._serve(body=True)

            def _send(self, status: int, data: bytes, headers: dict[str, str], body: bool) -> None:
                self.send_response(status)
                for k, v in {**headers, "Content-Length": str(len(data))}.items():
                    self.send_header(k, v)
                self.end_headers()
                if body:
                    self.wfile.write(data)

            def _json(self, obj, headers: dict[str, str] | None = None, body: bool = True) -> None:
                self._send(200, json.dumps(obj).encode(), {"Content-Type": "application/json", **(headers or {})}, body)

            def _serve(self, body: bool) -> None:
                with hub._lock:
                    hub.requests.append(f"{self.command} {self.path}")
                url = urlsplit(self.path)
                query = parse_qs(url.query)
                segs = [unquote(s) for s in url.path.split("/")[1:]]
                auth = self.headers.get("Authorization")
                try:
                    if url.path == "/api/agent-harnesses":  # huggingface_hub's best-effort agent registry lookup
                        return self._json({"standardEnvVars": [], "harnesses": {}}, body=body)
                    if segs[:2] == ["api", "models"]:
                        repo_id, rest = hub._split_repo(segs[2:])
                        if rest[:1] == ["tree"] and len(rest) >= 2:
                            while hub.stall_trees:  # until the hub closes
                                time.sleep(0.1)
                            sha = hub._check(repo_id, rest[1], auth)
                            recursive = query.get("recursive", ["false"])[0].lower() in ("true", "1")
                            entries = hub._tree(repo_id, "/".join(rest[2:]), recursive)
                            start = int(query.get("cursor", ["0"])[0])
                            end, headers = start + hub.page_size, {}
                            if end < len(entries):
                                nxt = f"{hub.url}{url.path}?recursive={str(recursive).lower()}&cursor={end}"
                                headers["Link"] = f'<{nxt}>; rel="next"'
                            return self._json(entries[start:end], headers, body)
                        if rest == [] or (rest[:1] == ["revision"] and len(rest) == 2):
                            sha = hub._check(repo_id, rest[1] if rest else None, auth)
                            return self._json(hub._info(repo_id, sha), body=body)
                    elif "resolve" in segs and len(segs) > segs.index("resolve") + 1:
                        i = segs.index("resolve")
                        repo_id, rev, path = "/".join(segs[:i]), segs[i + 1], "/".join(segs[i + 2 :])
                        sha = hub._check(repo_id, rev, auth)
                        data = hub._file(repo_id, path, sha)
                        headers = {
                            "X-Repo-Commit": sha,
                            "ETag": f'"{_blob_oid(data)}"',
                            "Accept-Ranges": "bytes",
                            "Content-Type": "application/octet-stream",
                        }
                        rng = self.headers.get("Range", "")
                        if rng.startswith("bytes=") and rng.endswith("-") and rng[6:-1].isdigit():
                            start = int(rng[6:-1])
                            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
                            return self._send(206, data[start:], headers, body)
                        return self._send(200, data, headers, body)
                    raise _HubError(404, "", f"FakeHub does not implement {self.command} {url.path}")
                except _HubError as e:
                    headers = {"Content-Type": "application/json", "X-Error-Message": e.message}
                    if e.code:
                        headers["X-Error-Code"] = e.code
                    if e.commit:
                        headers["X-Repo-Commit"] = e.commit
                    self._send(e.status, json.dumps({"error": e.message}).encode(), headers, body)

        return Handler


__all__ = ["FakeHub"]
