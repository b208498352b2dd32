"""A local stand-in for the part of the Hugging Face Hub HTTP API that `huggingface_hub` uses for the zoo.

It listens on 127.0.0.1 (a free port) and stores repos as real files on disk (model repos under
`<root>/<org>/<name>`, dataset repos under `<root>/@datasets/<org>/<name>`: '@' is never part of an org,
so the two kinds keep separate namespaces, as on the Hub):

    <root>/<org>/<name>/meta.json            {"private": bool}
    <root>/<org>/<name>/refs.json            {"branches": {"main": sha}, "tags": {name: sha}}
    <root>/<org>/<name>/commits/<sha>.json   {"parent": sha|None, "message": str, "tree": {path: blob sha256}}
    <root>/<org>/<name>/blobs/<sha256>       file contents

Endpoints (what the real client calls, read from huggingface_hub's source; {kind} is `models` or
`datasets`, {prefix} is empty for a model repo and `datasets/` for a dataset repo):
    POST /api/repos/create                            create_repo ("type": model/dataset; 409 when it exists)
    GET  /api/{kind}/{repo}[/revision/{rev}]          model_info / dataset_info / repo_info (sha, siblings)
    POST /api/{kind}/{repo}/preupload/{rev}           upload mode: always "regular" (inline base64, no LFS/Xet)
    POST /api/{kind}/{repo}/commit/{rev}              NDJSON commit; 412 when parentCommit is not the head
    GET  /api/{kind}/{repo}/refs                      list_repo_refs
    GET  /api/{kind}/{repo}/tree/{rev}[/{path}]       list_repo_tree (one page; `hf download` of a whole repo)
    POST /api/{kind}/{repo}/tag/{rev}                 create_tag (409 when the tag exists)
    HEAD/GET /{prefix}{repo}/resolve/{rev}/{path}     file metadata and download (ETag, X-Repo-Commit)
    POST /api/validate-yaml                           README metadata check (always fine)
A repo asked for under the other kind is "not found" (404 RepoNotFound), as on the Hub.

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
REPO_KINDS = {"models": "model", "datasets": "dataset"}  # URL segment -> repo type


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
    def repo_dir(self, repo_id: str, repo_type: str = "model") -> Path:
        org, _, name = repo_id.partition("/")
        for part in (org, name):
            if not part or part in (".", "..") or not set(part) <= _SAFE:
                raise HttpError(400, f"invalid repo id {repo_id!r}", "InvalidRepoId")
        if repo_type == "model":
            return self.root / org / name
        if repo_type == "dataset":
            return self.root / "@datasets" / org / name
        raise HttpError(400, f"invalid repo type {repo_type!r}", "InvalidRepoType")

    def exists(self, repo_id: str, repo_type: str = "model") -> bool:
        return (self.repo_dir(repo_id, repo_type) / "refs.json").is_file()

    def refs(self, repo_id: str, repo_type: str = "model") -> dict[str, dict[str, str]]:
        if not self.exists(repo_id, repo_type):
            raise HttpError(404, f"Repository {repo_id} not found", "RepoNotFound")
        return json.loads((self.repo_dir(repo_id, repo_type) / "refs.json").read_text())

    def _write_json(self, path: Path, data: Any) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, sort_keys=True))
        tmp.replace(path)

    def commit_data(self, repo_id: str, sha: str, repo_type: str = "model") -> dict[str, Any]:
        return json.loads((self.repo_dir(repo_id, repo_type) / "commits" / f"{sha}.json").read_text())

    def blob(self, repo_id: str, digest: str, repo_type: str = "model") -> bytes:
        return (self.repo_dir(repo_id, repo_type) / "blobs" / digest).read_bytes()

    def private(self, repo_id: str, repo_type: str = "model") -> bool:
        return json.loads((self.repo_dir(repo_id, repo_type) / "meta.json").read_text())["private"]

    def resolve(self, repo_id: str, revision: str, repo_type: str = "model") -> str:
        refs = self.refs(repo_id, repo_type)
        if revision in refs["branches"]:
            return refs["branches"][revision]
        if revision in refs["tags"]:
            return refs["tags"][revision]
        if len(revision) == 40 and (self.repo_dir(repo_id, repo_type) / "commits" / f"{revision}.json").is_file():
            return revision
        raise HttpError(404, f"Invalid rev id: {revision}", "RevisionNotFound")

    def tree(self, repo_id: str, revision: str, repo_type: str = "model") -> tuple[str, dict[str, str]]:
        sha = self.resolve(repo_id, revision, repo_type)
        return sha, self.commit_data(repo_id, sha, repo_type)["tree"]

    # -- writes ----------------------------------------------------------------------------
    def create(self, repo_id: str, private: bool, repo_type: str = "model") -> bool:
        with self.lock:
            if self.exists(repo_id, repo_type):
                return False
            d = self.repo_dir(repo_id, repo_type)
            (d / "commits").mkdir(parents=True, exist_ok=True)
            (d / "blobs").mkdir(exist_ok=True)
            self._write_json(d / "meta.json", {"private": bool(private)})
            self._write_json(d / "refs.json", {"branches": {}, "tags": {}})
            self.commit(repo_id, "main", {".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n"},
                        [], "initial commit", None, repo_type)
            return True

    def commit(self, repo_id: str, branch: str, additions: dict[str, bytes], deletions: list[str],
               message: str, parent: str | None, repo_type: str = "model") -> str:
        """Apply one commit atomically: blobs first, then the commit object, then the branch ref."""
        with self.lock:
            refs = self.refs(repo_id, repo_type)
            head = refs["branches"].get(branch)
            if head is None and refs["branches"]:
                raise HttpError(404, f"Invalid rev id: {branch}", "RevisionNotFound")
            if parent is not None and parent != head:
                raise HttpError(412, f"A commit has happened since. Please refresh and try again. "
                                     f"(parent {parent} is not the head {head})")
            tree = dict(self.commit_data(repo_id, head, repo_type)["tree"]) if head else {}
            for path in deletions:
                _safe_path(path.rstrip("/"))
                prefix = path.rstrip("/") + "/"
                gone = [p for p in tree if p == path or p.startswith(prefix)]
                if not gone:
                    raise HttpError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
                for p in gone:
                    del tree[p]
            d = self.repo_dir(repo_id, repo_type)
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

    def tag(self, repo_id: str, tag: str, revision: str, repo_type: str = "model") -> None:
        with self.lock:
            sha = self.resolve(repo_id, revision, repo_type)
            refs = self.refs(repo_id, repo_type)
            if tag in refs["tags"]:
                raise HttpError(409, f"Tag {tag} already exists", "TagExists")
            if not tag or not set(tag) <= _SAFE:
                raise HttpError(400, f"invalid tag {tag!r}")
            refs["tags"][tag] = sha
            self._write_json(self.repo_dir(repo_id, repo_type) / "refs.json", refs)


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

    def _authorize(self, repo_id: str | None, write: bool, repo_type: str = "model") -> None:
        auth = self.headers.get("Authorization")
        if auth:
            self.server.hub.auth_headers_seen.append(auth)
        token = self.server.hub.token
        if token is None:
            return
        private = False
        if repo_id and self.server.store.exists(repo_id, repo_type):
            private = self.server.store.private(repo_id, repo_type)
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
            if parts[:1] == ["api"] and len(parts) >= 4 and parts[1] in REPO_KINDS:
                return self._api(method, REPO_KINDS[parts[1]], f"{parts[2]}/{parts[3]}", parts[4:], body)
            # File URLs: /{org}/{name}/resolve/... for a model, /datasets/{org}/{name}/resolve/... for a dataset.
            kind, rest = ("dataset", parts[1:]) if parts[:1] == ["datasets"] else ("model", parts)
            if method in ("GET", "HEAD") and len(rest) >= 5 and rest[2] == "resolve":
                return self._resolve(f"{rest[0]}/{rest[1]}", rest[3], "/".join(rest[4:]), head, kind)
            raise HttpError(404, f"no route for {method} {self.path}")
        except HttpError as err:
            self._error(err, head=head)
        except (ValueError, KeyError) as err:
            self._error(HttpError(400, f"bad request: {err}"), head=head)

    def _api(self, method: str, repo_type: str, repo_id: str, rest: list[str], body: bytes) -> None:
        """The /api/{models|datasets}/{repo}/... routes; the same handlers serve both kinds."""
        if method == "GET" and not rest:
            return self._info(repo_id, "main", repo_type)
        if method == "GET" and rest[:1] == ["revision"] and len(rest) >= 2:
            return self._info(repo_id, "/".join(rest[1:]), repo_type)
        if method == "GET" and rest == ["refs"]:
            return self._refs(repo_id, repo_type)
        if method == "GET" and rest[:1] == ["tree"] and len(rest) >= 2:
            return self._tree(repo_id, rest[1], "/".join(rest[2:]), repo_type)
        if method == "POST" and rest[:1] == ["preupload"]:
            return self._preupload(repo_id, "/".join(rest[1:]), json.loads(body), repo_type)
        if method == "POST" and rest[:1] == ["commit"]:
            return self._commit(repo_id, "/".join(rest[1:]), body, repo_type)
        if method == "POST" and rest[:1] == ["tag"]:
            return self._tag(repo_id, "/".join(rest[1:]), json.loads(body), repo_type)
        raise HttpError(404, f"no route for {method} {self.path}")

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_HEAD(self) -> None:
        self._dispatch("HEAD")

    def do_POST(self) -> None:
        self._dispatch("POST")

    # -- endpoints -------------------------------------------------------------------------
    def _create(self, payload: dict[str, Any]) -> None:
        repo_id = f"{payload.get('organization')}/{payload.get('name')}"
        repo_type = payload.get("type") or "model"  # the client leaves "type" out for a model repo
        if repo_type not in REPO_KINDS.values():
            raise HttpError(400, f"only model and dataset repos are served here, not {repo_type!r}")
        self._authorize(repo_id, write=True, repo_type=repo_type)
        private = payload.get("private", payload.get("visibility") == "private")
        url = f"{self.server.hub.endpoint}/{'datasets/' if repo_type == 'dataset' else ''}{repo_id}"
        if not self.server.store.create(repo_id, bool(private), repo_type):
            return self._json(409, {"error": f"You already created this {repo_type} repo", "url": url})
        self._json(200, {"url": url, "name": repo_id, "id": repo_id})

    def _info(self, repo_id: str, revision: str, repo_type: str) -> None:
        self._authorize(repo_id, write=False, repo_type=repo_type)
        store = self.server.store
        sha, tree = store.tree(repo_id, revision, repo_type)
        info = {"id": repo_id, "sha": sha, "private": store.private(repo_id, repo_type),
                "siblings": [{"rfilename": p} for p in sorted(tree)]}
        if repo_type == "model":
            info["modelId"] = repo_id
        self._json(200, info)

    def _tree(self, repo_id: str, revision: str, folder: str, repo_type: str) -> None:
        """Files and folders under `folder` at `revision`, all in one page (no Link header), as the Hub lists
        them; `recursive=true` lists the whole subtree. Blob ids are git's, as in `_resolve`'s ETag."""
        from urllib.parse import parse_qs

        self._authorize(repo_id, write=False, repo_type=repo_type)
        store = self.server.store
        sha, tree = store.tree(repo_id, revision, repo_type)
        recursive = parse_qs(urlsplit(self.path).query).get("recursive", ["false"])[0] == "true"
        prefix = f"{folder.strip('/')}/" if folder.strip("/") else ""
        files, folders = {}, set()
        for path in sorted(tree):
            if not path.startswith(prefix):
                continue
            parts = path[len(prefix):].split("/")
            for depth in range(1, len(parts)):  # the folders on the way
                if recursive or depth == 1:
                    folders.add(prefix + "/".join(parts[:depth]))
            if recursive or len(parts) == 1:
                files[path] = store.blob(repo_id, tree[path], repo_type)
        if prefix and not files and not folders:
            raise HttpError(404, f"Entry not found: {folder}", "EntryNotFound", commit=sha)
        entries = [{"type": "directory", "oid": hashlib.sha1(f.encode()).hexdigest(), "size": 0, "path": f}
                   for f in sorted(folders)]
        entries += [{"type": "file", "oid": git_blob_sha1(data), "size": len(data), "path": path}
                    for path, data in files.items()]
        self._json(200, entries)

    def _refs(self, repo_id: str, repo_type: str) -> None:
        self._authorize(repo_id, write=False, repo_type=repo_type)
        refs = self.server.store.refs(repo_id, repo_type)
        self._json(200, {
            "branches": [{"name": n, "ref": f"refs/heads/{n}", "targetCommit": s} for n, s in refs["branches"].items()],
            "tags": [{"name": n, "ref": f"refs/tags/{n}", "targetCommit": s} for n, s in sorted(refs["tags"].items())],
            "converts": [],
        })

    def _preupload(self, repo_id: str, revision: str, payload: dict[str, Any], repo_type: str) -> None:
        self._authorize(repo_id, write=True, repo_type=repo_type)
        store = self.server.store
        _, tree = store.tree(repo_id, revision, repo_type)
        files = []
        for item in payload["files"]:
            path = _safe_path(item["path"])
            oid = git_blob_sha1(store.blob(repo_id, tree[path], repo_type)) if path in tree else None
            files.append({"path": path, "uploadMode": "regular", "shouldIgnore": False, "oid": oid})
        self._json(200, {"files": files, "commitOid": store.resolve(repo_id, revision, repo_type)})

    def _commit(self, repo_id: str, revision: str, body: bytes, repo_type: str) -> None:
        self._authorize(repo_id, write=True, repo_type=repo_type)
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
                                       header.get("parentCommit"), repo_type)
        hub.commits_applied += 1
        prefix = "datasets/" if repo_type == "dataset" else ""
        self._json(200, {"success": True, "commitOid": sha,
                         "commitUrl": f"{hub.endpoint}/{prefix}{repo_id}/commit/{sha}", "pullRequestUrl": None})

    def _tag(self, repo_id: str, revision: str, payload: dict[str, Any], repo_type: str) -> None:
        self._authorize(repo_id, write=True, repo_type=repo_type)
        self.server.store.tag(repo_id, payload["tag"], revision, repo_type)
        self._json(200, {})

    def _resolve(self, repo_id: str, revision: str, path: str, head: bool, repo_type: str) -> None:
        self._authorize(repo_id, write=False, repo_type=repo_type)
        store = self.server.store
        sha, tree = store.tree(repo_id, revision, repo_type)
        if path not in tree:
            raise HttpError(404, f"Entry not found: {path}", "EntryNotFound", commit=sha)
        data = store.blob(repo_id, tree[path], repo_type)
        etag = git_blob_sha1(data)
        if not head:
            self.server.hub.downloads.append(path)
            if path in self.server.hub.faults.get("corrupt", ()):
                data = data[:-1] + bytes([data[-1] ^ 0xFF])  # same size, different content
        self._send(200, data, {"ETag": f'"{etag}"', "X-Repo-Commit": sha, "Accept-Ranges": "none"},
                   content_type="application/octet-stream", head=head)


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
