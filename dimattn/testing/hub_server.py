"""A local stand-in for the Hugging Face Hub (the rehearsal's, configs/rehearsal.yaml): the subset
of the Hub's HTTP API that huggingface_hub, datasets and evaluate call, over a folder in the
Hub's layout (``<root>/{models,datasets,spaces}/<owner>/<name>/<files>``, one revision each),
so that the download rules run their real code path with ``HF_ENDPOINT`` pointing here.

Served: repo info (``/api/<kind>s/<repo>[/revision/<rev>]``: sha and siblings), the tree and
paths-info listings (HfFileSystem's), and ``resolve`` (HEAD and GET, with Range: parquet is read
in ranges when streamed) with the headers hf_hub_download reads (X-Repo-Commit, ETag,
Content-Length). Any revision names the one there is. Everything else is a 404, logged.

Each request is logged as a JSON line (``--log``) with the command line of the process that made
it (Linux: the client socket's inode, found among /proc/<pid>/fd), so that a test can tell which
workflow scripts reached the Hub: the login-node rules only.

    python -m dimattn.testing.hub_server ROOT --port 0 --log requests.jsonl   # prints the URL
"""

import argparse
import hashlib
import json
import os
import re
import threading
import time
from functools import lru_cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

KINDS = ("model", "dataset", "space")
# /<prefix><owner>/<name>/resolve/<revision>/<path>: models have no prefix
RESOLVE = re.compile(r"^/(?:(datasets|spaces)/)?([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")
API = re.compile(
    r"^/api/(models|datasets|spaces)/([^/]+/[^/]+)(?:/(revision|tree|paths-info)(?:/([^/]+))?(?:/(.*))?)?$"
)


@lru_cache(maxsize=None)
def _sha256(path: Path, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    return _sha256(path, path.stat().st_mtime_ns)


def repo_dir(root: Path, kind: str, repo: str) -> Path:
    return Path(root) / f"{kind}s" / repo


def repo_files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def repo_sha(folder: Path) -> str:
    """The one revision: a hash of the files' names and contents (40 hex digits, as a commit's)."""
    h = hashlib.sha1()
    for name in repo_files(folder):
        h.update(name.encode() + b"\0" + file_sha256(folder / name).encode())
    return h.hexdigest()


def _entry(folder: Path, rel: str) -> dict:
    path = folder / rel
    if path.is_dir():
        return {"type": "directory", "oid": hashlib.sha1(rel.encode()).hexdigest(), "path": rel}
    sha = file_sha256(path)
    size = path.stat().st_size
    # every file as an LFS one: its oid is the sha256 that hf_hub_download keeps its blob under
    return {
        "type": "file",
        "oid": sha[:40],
        "size": size,
        "path": rel,
        "lfs": {"oid": sha, "size": size, "pointerSize": 134},
    }


PEER_LOOKUPS = 5  # tries to find the process behind a connection (HubHandler.setup)


def _peer_cmdline(port: int) -> str | None:
    """The command line of the local process whose TCP socket has source port ``port``."""
    inode = None
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port:
                inode = fields[9]
                break
        if inode:
            break
    if not inode:
        return None
    target = f"socket:[{inode}]"
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd) == target:
                    return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
    return None


class HubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    root: Path
    log_path: Path | None
    lock = threading.Lock()

    def setup(self):
        super().setup()
        # /proc is read while the client may be mid-fork or between scheduler slices (2 busy
        # cores): a lookup that finds no process is retried before the request is logged as
        # nobody's (the rehearsal once logged a Llama file so).
        for attempt in range(PEER_LOOKUPS):
            self.peer = _peer_cmdline(self.client_address[1])
            if self.peer is not None:
                break
            time.sleep(0.05 * (attempt + 1))

    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass

    def _log(self, status: int) -> None:
        if self.log_path is None:
            return
        line = json.dumps({"method": self.command, "path": self.path, "status": status, "client": self.peer})
        with self.lock, open(self.log_path, "a") as f:
            f.write(line + "\n")

    def _send(self, status: int, body: bytes = b"", headers: dict | None = None, content_type="application/json"):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self._log(status)

    def _json(self, obj, status=200):
        self._send(status, json.dumps(obj).encode())

    def _missing(self, what: str):
        # huggingface_hub reads X-Error-Code to tell a missing repo from a missing file
        code = "RepoNotFound" if what == "repo" else "EntryNotFound"
        self._send(404, json.dumps({"error": f"{what} not found"}).encode(), {"X-Error-Code": code})

    def do_HEAD(self):
        self._dispatch()

    def do_GET(self):
        self._dispatch()

    def do_POST(self):
        length = int(self.headers.get("Content-Length") or 0)
        self.body = self.rfile.read(length) if length else b""
        self._dispatch()

    def _dispatch(self):
        url = urlsplit(self.path)
        path = unquote(url.path)
        if m := RESOLVE.match(path):
            prefix, repo, _, rel = m.groups()
            kind = {"datasets": "dataset", "spaces": "space", None: "model"}[prefix]
            return self._resolve(kind, repo, rel)
        if m := API.match(url.path):
            kinds, repo, op, revision, rel = m.groups()
            return self._api(kinds[:-1], unquote(repo), op, unquote(rel or ""), parse_qs(url.query))
        self._missing("endpoint")

    def _api(self, kind: str, repo: str, op: str | None, rel: str, query: dict):
        folder = repo_dir(self.root, kind, repo)
        if not folder.is_dir():
            return self._missing("repo")
        if op in (None, "revision"):
            info = {"_id": repo, "id": repo, "sha": repo_sha(folder), "private": False, "disabled": False,
                    "gated": False, "downloads": 0, "likes": 0, "tags": [], "lastModified": "2024-01-01T00:00:00.000Z",
                    "siblings": [{"rfilename": f, "size": (folder / f).stat().st_size} for f in repo_files(folder)]}
            if kind == "model":
                info["modelId"] = repo
            return self._json(info)
        if op == "tree":
            base = folder / rel
            if not base.is_dir():
                return self._missing("entry")
            recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
            children = base.rglob("*") if recursive else base.iterdir()
            return self._json([_entry(folder, p.relative_to(folder).as_posix()) for p in sorted(children)])
        if op == "paths-info":
            form = parse_qs(self.body.decode()) if self.body else {}
            wanted = form.get("paths", [])
            if not wanted and self.body.startswith(b"{"):
                wanted = json.loads(self.body).get("paths", [])
            return self._json([_entry(folder, p.strip("/")) for p in wanted if (folder / p.strip("/")).exists()])
        self._missing("endpoint")

    def _resolve(self, kind: str, repo: str, rel: str):
        folder = repo_dir(self.root, kind, repo)
        if not folder.is_dir():
            return self._missing("repo")
        path = folder / rel
        if not path.is_file():
            return self._missing("entry")
        data = path.read_bytes()
        sha = file_sha256(path)
        headers = {"X-Repo-Commit": repo_sha(folder), "ETag": f'"{sha}"', "X-Linked-Etag": f'"{sha}"',
                   "X-Linked-Size": str(len(data)), "Accept-Ranges": "bytes"}
        status = 200
        if m := re.match(r"bytes=(\d*)-(\d*)$", self.headers.get("Range", "")):
            start, stop = m.groups()
            if start == "":  # the last n bytes
                start, stop = max(0, len(data) - int(stop)), len(data) - 1
            start, stop = int(start), min(int(stop) if stop else len(data) - 1, len(data) - 1)
            headers["Content-Range"] = f"bytes {start}-{stop}/{len(data)}"
            data, status = data[start : stop + 1], 206
        self._send(status, data, headers, content_type="application/octet-stream")


def serve(root: Path, port: int = 0, log_path: Path | None = None) -> ThreadingHTTPServer:
    """A server on 127.0.0.1:port (0: any free port) in a daemon thread; its URL is
    ``f"http://127.0.0.1:{server.server_port}"``. Stop it with ``server.shutdown()``."""
    handler = type("Handler", (HubHandler,), {"root": Path(root), "log_path": Path(log_path) if log_path else None})
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--log", type=Path)
    a = ap.parse_args(argv)
    server = serve(a.root, a.port, a.log)
    print(f"http://127.0.0.1:{server.server_port}", flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main()
