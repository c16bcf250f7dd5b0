"""python manage.py checkpoint inspect|verify|export REF [OUT_DIR]

REF is a manifest hash or PROJECT:vN (a policy version). `verify` walks the delta chain and
checks every hash (exit 1 on any corruption); `export` writes an HF folder that transformers and
vLLM load.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from training.checkpoints.store import CheckpointCorrupt
from training.models import PolicyVersion
from training.versions.services import checkpoint_store


class Command(BaseCommand):
    help = "Inspect, verify or export a stored checkpoint (by manifest hash or PROJECT:vN)."

    def add_arguments(self, parser):
        parser.add_argument("action", choices=["inspect", "verify", "export"])
        parser.add_argument("ref")
        parser.add_argument("out_dir", nargs="?")

    def handle(self, *args, **opts):

        store, ref = checkpoint_store(), _manifest_hash(opts["ref"])
        try:
            if opts["action"] == "inspect":
                self.stdout.write(json.dumps(_summary(store, ref), indent=2))
            elif opts["action"] == "verify":
                with tempfile.TemporaryDirectory() as tmp:
                    store.materialise(ref, Path(tmp) / "out")
                self.stdout.write(f"OK {ref}: every tensor and link verified")
            else:
                if not opts["out_dir"]:
                    raise CommandError("export needs OUT_DIR: manage.py checkpoint export REF OUT_DIR")
                self.stdout.write(str(store.materialise(ref, opts["out_dir"])))
        except CheckpointCorrupt as exc:
            raise CommandError(f"checkpoint {ref[:12]} is refused: {exc}") from exc
        except FileExistsError as exc:
            raise CommandError(f"{exc}; choose an empty or new folder") from exc


def _manifest_hash(ref: str) -> str:
    if ":v" not in ref:
        return ref

    slug, number = ref.rsplit(":v", 1)
    version = PolicyVersion.objects.filter(project__slug=slug, number=int(number) if number.isdigit() else -1).first()
    if version is None or not version.manifest_hash:
        raise CommandError(f"no stored checkpoint for {ref}: check the project slug and version number")
    return version.manifest_hash


def _summary(store, ref: str) -> dict:
    manifest = store.manifest(ref)
    chain = [ref]
    while store.manifest(chain[-1])["kind"] == "delta":
        chain.append(store.manifest(chain[-1])["parent"])
    return {
        "manifest": ref, "kind": manifest["kind"], "parent": manifest["parent"], "depth": manifest["depth"],
        "chain_to_full_snapshot": chain[::-1], "raw_bytes": manifest["raw_bytes"],
        "blob_bytes": manifest["blob_bytes"], "ratio": round(manifest["raw_bytes"] / max(manifest["blob_bytes"], 1), 2),
        "files": sorted(manifest["files"]), "meta": manifest["meta"],
    }
