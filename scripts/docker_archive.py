"""Write a `docker load` archive of one layer from a root file system directory (the lab's stand-in images).

    python3 scripts/docker_archive.py ROOT TAG OUT.tar [--env K=V ...] [--entrypoint PATH] [--label TEXT]

The layer is ROOT as it is (numeric owners); the image config carries the environment, the entrypoint, `Cmd` bash
and the label `yrpd.lab.standin` (what the image stands in for, in words). Written beside OUT and renamed into place.
"""

import argparse
import hashlib
import json
import os
import subprocess
import tempfile


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("tag")
    ap.add_argument("out")
    ap.add_argument("--env", action="append", default=[])
    ap.add_argument("--entrypoint")
    ap.add_argument("--label", default="FAKE image of the yrpd lab")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(a.out))) as tmp:
        layer = os.path.join(tmp, "layer.tar")
        subprocess.run(["tar", "-C", a.root, "--numeric-owner", "-cf", layer, "."], check=True)
        digest = hashlib.sha256()
        with open(layer, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                digest.update(chunk)
        diff_id = digest.hexdigest()
        os.makedirs(os.path.join(tmp, "archive", diff_id))
        os.rename(layer, os.path.join(tmp, "archive", diff_id, "layer.tar"))
        config = {
            "architecture": "amd64", "os": "linux",
            "config": {"Env": a.env, "Cmd": ["/bin/bash"], "Labels": {"yrpd.lab.standin": a.label},
                       **({"Entrypoint": [a.entrypoint]} if a.entrypoint else {})},
            "rootfs": {"type": "layers", "diff_ids": [f"sha256:{diff_id}"]},
        }
        raw = json.dumps(config).encode()
        name = hashlib.sha256(raw).hexdigest() + ".json"
        with open(os.path.join(tmp, "archive", name), "wb") as fh:
            fh.write(raw)
        with open(os.path.join(tmp, "archive", "manifest.json"), "w") as fh:
            json.dump([{"Config": name, "RepoTags": [a.tag], "Layers": [f"{diff_id}/layer.tar"]}], fh)
        part = a.out + ".part"
        subprocess.run(["tar", "-C", os.path.join(tmp, "archive"), "-cf", part, "."], check=True)
        os.replace(part, a.out)


if __name__ == "__main__":
    main()
