"""Proof of what is served: the trainer's log-probs for a version on the probe prompts, and the
check a replica's staged weights must pass before they serve (`ReplicaAgent.verify`, run by
`PolicyServer` after every load and before the swap).

The reference is computed by the torch engine from the version's checkpoint in the store: the
trainer's forward (full weights scored batch-invariantly; an adapter version as PEFT's LoRA
layers over its base, as the run trained it), cached per manifest under FLYWHEEL_VAR_DIR/probes.
The replica reports the checkpoint hash of the folder it loaded, compared with the manifest's, and
its probe log-probs, compared within the engine's tolerance (inference/probe.py). A mismatch is a
refused swap: the old version keeps serving, the replica row shows it, and the serving process
counts it (flywheel_serving_probe{outcome="refused"}; the web app's flywheel_replica_probe_failed).

    .venv/bin/python -m pytest tests/training/replicas/test_probe.py -q
"""

from __future__ import annotations

import json
import math
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from django.conf import settings
from django.utils import timezone

from inference.engines import AdapterView, Engine, TorchEngine, is_adapter_folder, read_state_dict
from inference.engines.adapters import ADAPTER_CONFIG
from inference.probe import probe_compare, probe_run, tolerance
from kernels.delta import checkpoint_hash
from training.models import PolicyVersion
from training.versions.services import checkpoint_store, policy_adapter_folder, policy_folder

ADAPTER_WEIGHTS = "adapter_model.safetensors"


@dataclass(frozen=True)
class ProbeReport:
    version: int
    role: str
    ok: bool
    max_diff: float | None
    tolerance: float
    loaded_hash: str
    expected_hash: str | None  # None: nothing stored to compare with (a folder-only or merged version)
    problem: str = ""
    at: str = ""

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["max_diff"] = None if self.max_diff is None or math.isinf(self.max_diff) else self.max_diff
        return out


def probe_reference(version: PolicyVersion) -> dict[str, Any]:
    """The trainer's greedy probe tokens and log-probs for `version` (cached per manifest; a
    folder-only version, whose folder may change under the same row, is probed each time)."""
    path = Path(settings.VAR_DIR) / "probes" / f"{version.manifest_hash}.json" if version.manifest_hash else None
    if path is not None and path.exists():
        return json.loads(path.read_text())
    if version.adapter_base_id is not None:
        host = TorchEngine(policy_folder(version.adapter_base))
        engine: Engine = AdapterView(host, policy_adapter_folder(version), version.number)
    else:
        host = engine = TorchEngine(policy_folder(version))
    try:
        reference = probe_run(engine)
    finally:
        engine.close()
        host.close()
    if path is None:
        return reference
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".probe-")
    with os.fdopen(fd, "w") as f:
        json.dump(reference, f)
    os.replace(tmp, path)  # a reader never sees half of it
    return reference


def loaded_hash(folder: Path) -> str:
    """The checkpoint hash (kernels.delta) of the weights in `folder`: an adapter's tensors, or
    the full state dict; what the manifest of the version names when the folder is right."""
    if (folder / ADAPTER_CONFIG).is_file():
        from safetensors.torch import load_file

        return checkpoint_hash(load_file(folder / ADAPTER_WEIGHTS))
    return checkpoint_hash(read_state_dict(folder))


def expected_hash(version: PolicyVersion, folder: Path) -> str | None:
    """The manifest's checkpoint hash, when `folder` holds what the manifest describes (an adapter
    version served merged does not: its folder is the base with the adapter merged in)."""
    if not version.manifest_hash or (version.adapter_base_id is not None and not is_adapter_folder(folder)):
        return None
    return str(checkpoint_store().manifest(version.manifest_hash)["checkpoint_hash"])


def probe_verify(version: PolicyVersion, engine: Engine, folder: Path, role: str, engine_kind: str,
                 dtype: str = "float32") -> ProbeReport:
    """Probes the staged `engine` (loaded from `folder`) against the trainer's reference."""
    tol = tolerance(engine_kind, dtype)
    loaded, expected = loaded_hash(folder), expected_hash(version, folder)
    at = timezone.now().isoformat()
    if expected is not None and loaded != expected:
        return ProbeReport(version.number, role, False, None, tol, loaded, expected,
                           f"the folder loaded for v{version.number} holds other weights than its checkpoint "
                           f"(hash {loaded[:12]}, the manifest names {expected[:12]})", at)
    verdict = probe_compare(probe_reference(version), probe_run(engine), tol)
    return ProbeReport(version.number, role, verdict.ok, verdict.max_diff, tol, loaded, expected,
                       verdict.problem, at)
