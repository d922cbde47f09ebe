"""Download one source distribution from the package index pip is configured with, check it, unpack it.

    python scripts/fetch_sdist.py NAME VERSION SHA256 DEST     (prints DEST/<name>-<version>, the unpacked tree)

For sources whose build needs what this machine cannot install (vLLM 0.10.0's setup.py imports torch and its
build requirements pin a CUDA torch), so `pip download`, which always prepares an sdist's metadata, cannot fetch
them. The index is pip's own (PIP_INDEX_URL, `pip config`, else pip's default); the archive must have SHA256.
Cached: an unpacked tree with its `.complete` marker is reused; nothing is half-written (unpacked beside, renamed).
"""

from __future__ import annotations

import hashlib
import html.parser
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path


def index_url() -> str:
    url = os.environ.get("PIP_INDEX_URL", "")
    if not url:
        got = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global.index-url"],
                             capture_output=True, text=True)
        url = got.stdout.strip() if got.returncode == 0 else ""
    if not url:
        from pip._internal.models.index import PyPI  # pip's default index, as pip itself resolves it

        url = PyPI.simple_url
    return url.rstrip("/") + "/"


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag == "a":
            self.links += [value for key, value in attrs if key == "href" and value]


def find(name: str, filename: str) -> str:
    page = urllib.parse.urljoin(index_url(), f"{name}/")
    with urllib.request.urlopen(urllib.request.Request(page, headers={"Accept": "text/html"}), timeout=120) as r:
        parser = _Links()
        parser.feed(r.read().decode("utf-8", "replace"))
    for link in parser.links:
        if urllib.parse.urlparse(link).path.rsplit("/", 1)[-1] == filename:
            return urllib.parse.urljoin(page, link.split("#", 1)[0])
    raise SystemExit(f"fetch_sdist: {filename} is not on the package index pip uses ({page})")


def main(argv: list[str]) -> int:
    if len(argv) != 4:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    name, version, sha256, dest = argv
    tree = Path(dest) / f"{name}-{version}"
    if (tree / ".complete").is_file():
        print(tree)
        return 0
    Path(dest).mkdir(parents=True, exist_ok=True)
    filename = f"{name}-{version}.tar.gz"
    with tempfile.TemporaryDirectory(dir=dest, prefix=".fetch-") as tmp:
        archive = Path(tmp) / filename
        with urllib.request.urlopen(find(name, filename), timeout=600) as r, archive.open("wb") as out:
            shutil.copyfileobj(r, out)
        got = hashlib.sha256(archive.read_bytes()).hexdigest()
        if got != sha256:
            raise SystemExit(f"fetch_sdist: {filename} has sha256 {got}, expected {sha256}: refusing it")
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        unpacked = Path(tmp) / f"{name}-{version}"
        (unpacked / ".complete").write_text(sha256 + "\n")
        shutil.rmtree(tree, ignore_errors=True)
        unpacked.rename(tree)
    print(tree)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
