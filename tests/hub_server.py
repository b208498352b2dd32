"""A local stand-in for the part of the Hugging Face Hub HTTP API that `huggingface_hub` uses for the zoo.

It listens on 127.0.0.1 (a free port) and stores repos as real files on disk:

    <root>/<org>/<name>/meta.json            {"private": bool}
    <root>/<org>/<name>/refs.json            {"branches": {"main": sha}, "tags": {name: sha}}
    <root>/<org>/<name>/commits/<sha>.json   {"parent": sha|None, "message": str, "tree": {path: blob sha256}}
    <root>/<org>/<name>/blobs/<sha256>       file contents

Endpoints (what the real client calls, read from huggingface_hub's source):
    POST /api/repos/create                            create_repo (409 when it exists)
    GET  /api/models/{repo}[/revision/{rev}]          model_info / repo_info (sha, siblings)
    POST /api/models/{repo}/preupload/{rev}           upload mode: always "regular" (inline base64, no LFS/Xet)
    POST /api/models/{repo}/commit/{rev}              NDJSON commit; 412 when parentCommit is not the head
    GET  /api/models/{repo}/refs                      list_repo_refs
    POST /api/models/{repo}/tag/{rev}                 create_tag (409 when the tag exists)
    HEAD/GET /{repo}/resolve/{rev}/{path}             file metadata and download (ETag, X-Repo-Commit)
    POST /api/validate-yaml                           README metadata check (always fine)

Fault injection for tests (`HubServer.faults`): `commit_errors` (answer that many commits with 500
after reading the whole upload), `corrupt` (paths served with one byte flipped, same size),
`before_commit` (a callable run once before the next commit is applied: a racing publisher).
`HubServer.auth_headers_seen` records Authorization headers so tests can prove a token was sent.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import unquote, urlsplit

_SAFE = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob: what the Hub reports as the ETag / oid of a regular file."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class HttpError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, commit: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.commit = status, message, code, commit


def _safe_path(path: str) -> str:
    """Refuse paths a real Hub would refuse: absolute, '..', empty or odd components."""
    parts = PurePosixPath(path).parts
    if not path or path.startswith("/") or any(p in ("", ".", "..") or not set(p) <= _SAFE for p in parts):
        raise HttpError(400, f"invalid path {path!r}", "InvalidPath")
    return path


class HubStore:
    """Repos on disk; one lock serialises every write so commits are atomic."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.lock = threading.RLock()
        self._counter = 0

    # -- repo files ------------------------------------------------------------------------
    def repo_dir(self, repo_id: str) -> Path:
        org, _, name = repo_id.partition("/")
        for part in (org, name):
            if not part or part in (".", "..") or not set(part) <= _SAFE:
                raise HttpError(400, f"invalid repo id {repo_id!r}", "InvalidRepoId")
        return self.root / org / name

    def exists(self, repo_id: str) -> bool:
        return (self.repo_dir(repo_id) / "refs.json").is_file()

    def refs(self, repo_id: str) -> dict[str, dict[str, str]]:
        if not self.exists(repo_id):
            raise HttpError(404, f"Repository {repo_id} not found", "RepoNotFound")
        return json.loads((self.repo_dir(repo_id) / "refs.json").read_text())

    def _write_json(self, path: Path, data: Any) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, sort_keys=True))
        tmp.replace(path)

    def commit_data(self, repo_id: str, sha: str) -> dict[str, Any]:
        return json.loads((self.repo_dir(repo_id) / "commits" / f"{sha}.json").read_text())

    def blob(self, repo_id: str, digest: str) -> bytes:
        return (self.repo_dir(repo_id) / "blobs" / digest).read_bytes()

    def resolve(self, repo_id: str, revision: str) -> str:
        refs = self.refs(repo_id)
        if revision in refs["branches"]:
            return refs["branches"][revision]
        if revision in refs["tags"]:
            return refs["tags"][revision]
        if len(revision) == 40 and (self.repo_dir(repo_id) / "commits" / f"{revision}.json").is_file():
            return revision
        raise HttpError(404, f"Invalid rev id: {revision}", "RevisionNotFound")

    def tree(self, repo_id: str, revision: str) -> tuple[str, dict[str, str]]:
        sha = self.resolve(repo_id, revision)
        return sha, self.commit_data(repo_id, sha)["tree"]

    # -- writes ----------------------------------------------------------------------------
    def create(self, repo_id: str, private: bool) -> bool:
        with self.lock:
            if self.exists(repo_id):
                return False
            d = self.repo_dir(repo_id)
            (d / "commits").mkdir(parents=True, exist_ok=True)
            (d / "blobs").mkdir(exist_ok=True)
            self._write_json(d / "meta.json", {"private": bool(private)})
            self._write_json(d / "refs.json", {"branches": {}, "tags": {}})
            self.commit(repo_id, "main", {".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"},
                        [], "initial commit", None)
            return True

    def commit(self, repo_id: str, branch: str, additions: dict[str, bytes], deletions: list[str],
               message: str, parent: str | None) -> str:
        """Apply one commit atomically: blobs first, then the commit object, then the branch ref."""
        with self.lock:
            refs = self.refs(repo_id)
            head = refs["branches"].get(branch)
            if head is None and refs["branches"]:
                raise HttpError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
            if parent is not None and parent != head:
                raise HttpError(412, f"A commit has happened since. Please refresh and try again. "
                                     f"(parent {parent} is not the head {head})")
            tree = dict(self.commit_data(repo_id, head)["tree"]) if head else {}
            for path in deletions:
                _safe_path(path.rstrip("/"))
                prefix = path.rstrip("/") + "/"
                gone = [p for p in tree if p == path or p.startswith(prefix)]
                if not gone:
                    raise HttpError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
                for p in gone:
                    del tree[p]
            d = self.repo_dir(repo_id)
            for path, data in additions.items():
                _safe_path(path)
                digest = hashlib.sha256(data).hexdigest()
                (d / "blobs" / digest).write_bytes(data)
                tree[path] = digest
            self._counter += 1
            body = {"parent": head, "message": message, "tree": tree}
            sha = hashlib.sha1(json.dumps([body, self._counter, time.time()]).encode()).hexdigest()
            self._write_json(d / "commits" / f"{sha}.json", body)
            refs["branches"][branch] = sha
            self._write_json(d / "refs.json", refs)
            return sha

    def tag(self, repo_id: str, tag: str, revision: str) -> None:
        with self.lock:
            sha = self.resolve(repo_id, revision)
            refs = self.refs(repo_id)
            if tag in refs["tags"]:
                raise HttpError(409, f"Tag {tag} already exists", "TagExists")
            if not tag or not set(tag) <= _SAFE:
                raise HttpError(400, f"invalid tag {tag!r}")
            refs["tags"][tag] = sha
            self._write_json(self.repo_dir(repo_id) / "refs.json", refs)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # quiet: tests read their own output
        pass

    # -- plumbing --------------------------------------------------------------------------
    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
            return b"".join(chunks)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None,
              content_type: str = "application/json", head: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _json(self, status: int, data: Any, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(data).encode(), headers)

    def _error(self, err: HttpError, head: bool = False) -> None:
        headers = {"X-Error-Message": err.message}
        if err.code:
            headers["X-Error-Code"] = err.code
        if err.commit:
            headers["X-Repo-Commit"] = err.commit
        self._send(err.status, json.dumps({"error": err.message}).encode(), headers, head=head)

    def _authorize(self, repo_id: str | None, write: bool) -> None:
        auth = self.headers.get("Authorization")
        if auth:
            self.server.hub.auth_headers_seen.append(auth)
        token = self.server.hub.token
        if token is None:
            return
        private = False
        if repo_id and self.server.store.exists(repo_id):
            private = json.loads((self.server.store.repo_dir(repo_id) / "meta.json").read_text())["private"]
        if (write or private) and auth != f"Bearer {token}":
            if private and not write:
                raise HttpError(404, f"Repository {repo_id} not found", "RepoNotFound")
            raise HttpError(401, "Invalid credentials in Authorization header")

    def _dispatch(self, method: str) -> None:
        head = method == "HEAD"
        try:
            parts = [unquote(p) for p in urlsplit(self.path).path.split("/")[1:]]
            body = self._body() if method == "POST" else b""
            if method == "POST" and parts[:3] == ["api", "repos", "create"]:
                return self._create(json.loads(body or b"{}"))
            if method == "POST" and parts[:2] == ["api", "validate-yaml"]:
                return self._json(200, {"errors": [], "warnings": []})
            if parts[:2] == ["api", "models"] and len(parts) >= 4:
                repo_id = f"{parts[2]}/{parts[3]}"
                rest = parts[4:]
                if method == "GET" and not rest:
                    return self._info(repo_id, "main")
                if method == "GET" and rest[:1] == ["revision"] and len(rest) >= 2:
                    return self._info(repo_id, "/".join(rest[1:]))
                if method == "GET" and rest == ["refs"]:
                    return self._refs(repo_id)
                if method == "POST" and rest[:1] == ["preupload"]:
                    return self._preupload(repo_id, "/".join(rest[1:]), json.loads(body))
                if method == "POST" and rest[:1] == ["commit"]:
                    return self._commit(repo_id, "/".join(rest[1:]), body)
                if method == "POST" and rest[:1] == ["tag"]:
                    return self._tag(repo_id, "/".join(rest[1:]), json.loads(body))
            if method in ("GET", "HEAD") and len(parts) >= 5 and parts[2] == "resolve":
                return self._resolve(f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]), head)
            raise HttpError(404, f"no route for {method} {self.path}")
        except HttpError as err:
            self._error(err, head=head)
        except (ValueError, KeyError) as err:
            self._error(HttpError(400, f"bad request: {err}"), head=head)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    # -- endpoints -------------------------------------------------------------------------
    def _create(self, payload: dict[str, Any]) -> None:
        repo_id = f"{payload.get('organization')}/{payload.get('name')}"
        if payload.get("type", "model") not in ("model", None):
            raise HttpError(400, "only model repos are served here")
        self._authorize(repo_id, write=True)
        private = payload.get("private", payload.get("visibility") == "private")
        url = f"{self.server.hub.endpoint}/{repo_id}"
        if not self.server.store.create(repo_id, bool(private)):
            return self._json(409, {"error": "You already created this model repo", "url": url})
        self._json(200, {"url": url, "name": repo_id, "id": repo_id})

    def _info(self, repo_id: str, revision: str) -> None:
        self._authorize(repo_id, write=False)
        sha, tree = self.server.store.tree(repo_id, revision)
        meta = json.loads((self.server.store.repo_dir(repo_id) / "meta.json").read_text())
        self._json(200, {"id": repo_id, "modelId": repo_id, "sha": sha, "private": meta["private"],
                         "siblings": [{"rfilename": p} for p in sorted(tree)]})

    def _refs(self, repo_id: str) -> None:
        self._authorize(repo_id, write=False)
        refs = self.server.store.refs(repo_id)
        self._json(200, {
            "branches": [{"name": n, "ref": f"refs/heads/{n}", "targetCommit": s} for n, s in refs["branches"].items()],
            "tags": [{"name": n, "ref": f"refs/tags/{n}", "targetCommit": s} for n, s in sorted(refs["tags"].items())],
            "converts": [],
        })

    def _preupload(self, repo_id: str, revision: str, payload: dict[str, Any]) -> None:
        self._authorize(repo_id, write=True)
        store = self.server.store
        _, tree = store.tree(repo_id, revision)
        files = []
        for item in payload["files"]:
            path = _safe_path(item["path"])
            oid = git_blob_sha1(store.blob(repo_id, tree[path])) if path in tree else None
            files.append({"path": path, "uploadMode": "regular", "shouldIgnore": False, "oid": oid})
        self._json(200, {"files": files, "commitOid": store.resolve(repo_id, revision)})

    def _commit(self, repo_id: str, revision: str, body: bytes) -> None:
        self._authorize(repo_id, write=True)
        hub = self.server.hub
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        header = next((x["value"] for x in lines if x["key"] == "header"), None)
        if header is None:
            raise HttpError(400, "missing header line")
        additions: dict[str, bytes] = {}
        deletions: list[str] = []
        for item in lines:
            key, value = item["key"], item["value"]
            if key == "file":
                additions[_safe_path(value["path"])] = base64.b64decode(value["content"], validate=True)
            elif key in ("deletedFile", "deletedFolder"):
                deletions.append(value["path"])
            elif key != "header":
                raise HttpError(400, f"unsupported commit operation {key!r} (this server takes inline files only)")
        with hub.fault_lock:
            fail = hub.faults.get("commit_errors", 0) > 0
            if fail:
                hub.faults["commit_errors"] -= 1
            hook = hub.faults.pop("before_commit", None)
        if fail:  # the whole upload was received; the server breaks before applying it
            raise HttpError(500, "Internal Error - simulated failure while applying the commit")
        if hook is not None:
            hook()
        sha = self.server.store.commit(repo_id, revision, additions, deletions, header.get("summary", ""),
                                       header.get("parentCommit"))
        hub.commits_applied += 1
        self._json(200, {"success": True, "commitOid": sha, "commitUrl": f"{hub.endpoint}/{repo_id}/commit/{sha}",
                         "pullRequestUrl": None})

    def _tag(self, repo_id: str, revision: str, payload: dict[str, Any]) -> None:
        self._authorize(repo_id, write=True)
        self.server.store.tag(repo_id, payload["tag"], revision)
        self._json(200, {})

    def _resolve(self, repo_id: str, revision: str, path: str, head: bool) -> None:
        self._authorize(repo_id, write=False)
        store = self.server.store
        sha, tree = store.tree(repo_id, revision)
        if path not in tree:
            raise HttpError(404, f"Entry not found: {path}", "EntryNotFound", commit=sha)
        data = store.blob(repo_id, tree[path])
        etag = git_blob_sha1(data)
        if not head:
            self.server.hub.downloads.append(path)
            if path in self.server.hub.faults.get("corrupt", ()):
                data = data[:-1] + bytes([data[-1] ^ 0xFF])  # same size, different content
        self._send(200, data, {"ETag": f'"{etag}"', "X-Repo-Commit": sha, "Accept-Ranges": "none"},
                   content_type="application/octet-stream", head=head)
        if head:
            return


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    store: HubStore
    hub: HubServer


class HubServer:
    """Run the fake Hub in a background thread: `with HubServer(tmp_path) as hub: HfApi(endpoint=hub.endpoint)`."""

    def __init__(self, root: Path, token: str | None = None, port: int = 0):
        self.store = HubStore(root)
        self.token = token
        self.faults: dict[str, Any] = {}
        self.fault_lock = threading.Lock()
        self.auth_headers_seen: list[str] = []
        self.downloads: list[str] = []
        self.commits_applied = 0
        self._httpd = _Server(("127.0.0.1", port), _Handler)
        self._httpd.store = self.store
        self._httpd.hub = self
        self.endpoint = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)

    def start(self) -> HubServer:
        self._thread.start()
        self._running = True
        return self

    def stop(self) -> None:
        """Stop serving (idempotent): later requests get 'connection refused', like a Hub that is down."""
        if getattr(self, "_running", False):
            self._running = False
            self._httpd.shutdown()
            self._httpd.server_close()

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def set_before_commit(self, hook: Callable[[], None]) -> None:
        with self.fault_lock:
            self.faults["before_commit"] = hook


if __name__ == "__main__":  # try push / pull / zoo list locally: python tests/hub_server.py ROOT --port 8765
    import argparse

    parser = argparse.ArgumentParser(description="Serve a local stand-in for the Hub's zoo API until Ctrl-C.")
    parser.add_argument("root", type=Path, help="Folder where repos are stored (created if missing).")
    parser.add_argument("--port", type=int, default=8765)
    args = parser.parse_args()
    server = HubServer(args.root, port=args.port).start()
    print(f"serving {args.root} at {server.endpoint}; export HF_ENDPOINT={server.endpoint}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.stop()
