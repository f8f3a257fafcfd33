"""Wrap one filesystem tar as a one-layer OCI image archive that ``ctr images import`` takes.

    python3 oci_archive.py LAYER.tar OUT.tar REF [--entrypoint P] [--cmd C] [--user U]

The archive holds ``oci-layout``, ``index.json`` (the manifest annotated with ``REF`` as
``io.containerd.image.name`` and as ``org.opencontainers.image.ref.name``) and the blobs: the
gzipped layer, the image config (linux/amd64) and the manifest. Used by kubelet.sh for the
pause image and the plain python test image.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import shutil
import tarfile
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("layer")
    parser.add_argument("out")
    parser.add_argument("ref")
    parser.add_argument("--entrypoint", action="append", default=[])
    parser.add_argument("--cmd", action="append", default=[])
    parser.add_argument("--user", default="")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        blobs = Path(tmp) / "blobs" / "sha256"
        blobs.mkdir(parents=True)
        diff = hashlib.sha256()
        packed = Path(tmp) / "layer.tar.gz"
        with open(args.layer, "rb") as src, open(packed, "wb") as raw:
            with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, compresslevel=6) as gz:
                while chunk := src.read(1 << 20):
                    diff.update(chunk)
                    gz.write(chunk)
        layer_digest = hashlib.sha256(packed.read_bytes()).hexdigest()
        shutil.move(packed, blobs / layer_digest)

        def blob(data: bytes) -> tuple[str, int]:
            digest = hashlib.sha256(data).hexdigest()
            (blobs / digest).write_bytes(data)
            return f"sha256:{digest}", len(data)

        config: dict = {
            "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"]
        }
        if args.entrypoint:
            config["Entrypoint"] = args.entrypoint
        if args.cmd:
            config["Cmd"] = args.cmd
        if args.user:
            config["User"] = args.user
        cfg_digest, cfg_size = blob(
            json.dumps(
                {
                    "architecture": "amd64",
                    "os": "linux",
                    "config": config,
                    "rootfs": {"type": "layers", "diff_ids": [f"sha256:{diff.hexdigest()}"]},
                    "history": [{"created_by": "oci_archive.py"}],
                }
            ).encode()
        )
        man_digest, man_size = blob(
            json.dumps(
                {
                    "schemaVersion": 2,
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "config": {
                        "mediaType": "application/vnd.oci.image.config.v1+json",
                        "digest": cfg_digest,
                        "size": cfg_size,
                    },
                    "layers": [
                        {
                            "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                            "digest": f"sha256:{layer_digest}",
                            "size": (blobs / layer_digest).stat().st_size,
                        }
                    ],
                }
            ).encode()
        )
        index = {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": man_digest,
                    "size": man_size,
                    "annotations": {
                        "io.containerd.image.name": args.ref,
                        "org.opencontainers.image.ref.name": args.ref,
                    },
                    "platform": {"architecture": "amd64", "os": "linux"},
                }
            ],
        }
        (Path(tmp) / "index.json").write_text(json.dumps(index))
        (Path(tmp) / "oci-layout").write_text('{"imageLayoutVersion": "1.0.0"}')
        with tarfile.open(args.out + ".part", "w") as out:
            for name in ("oci-layout", "index.json", "blobs"):
                out.add(Path(tmp) / name, arcname=name)
        Path(args.out + ".part").rename(args.out)


if __name__ == "__main__":
    main()
