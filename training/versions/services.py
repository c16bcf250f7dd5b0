"""Writes of policy versions: registering weights in the checkpoint store, materialising them,
and the one audited state transition every other service goes through.

    .venv/bin/python -m pytest tests/training/checkpoints/test_checkpoint_store.py tests/training/promotion/test_promotion.py -q
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from django.conf import settings
from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
from django.db import transaction

from core.errors import BadRequest, Conflict, NotFound
from core.notify import project_event
from feedback.auth import Principal
from feedback.models import Project
from training.models import AuditLog, PolicyVersion, VersionState

Actor = AbstractBaseUser | AnonymousUser | Principal | str  # str: a system actor, e.g. "system:canary"


def actor_name(actor: Actor) -> str:
    if isinstance(actor, str):
        return actor
    if isinstance(actor, Principal):
        # A key bound to a person or service account acts as them: the row names both.
        suffix = "" if actor.name == "default" else f":{actor.name}"
        key = f"api_key:{actor.project.slug}{suffix}"
        return key if actor.owner is None else f"{actor.owner.get_username()} via {key}"[:150]
    return (actor.get_username() or "anonymous")[:150]



def version_snapshot(version: PolicyVersion) -> dict[str, Any]:
    return {"version_id": version.id, "number": version.number, "state": version.state}


def version_audit(version: PolicyVersion, actor: Actor, action: str, before: dict | None, reason: str = "",
           **after_extra: Any) -> AuditLog:
    return AuditLog.objects.create(
        project_id=version.project_id, actor=actor_name(actor), action=action, target=f"policy_version:{version.id}",
        before=before, after={**version_snapshot(version), **after_extra}, reason=reason,
    )


def version_transition(version: PolicyVersion, state: str, actor: Actor, action: str, reason: str = "", **extra: Any) -> None:
    """Moves the version to `state` (one of `PolicyVersion.TRANSITIONS`), audited and announced."""
    if not version.can_become(state):
        raise Conflict(f"policy v{version.number} is {version.state}; it cannot become {state}",
                       f"From {version.state} it can become: "
                       f"{', '.join(sorted(map(str, version.TRANSITIONS.get(version.state, ())))) or 'nothing'}.")
    before = version_snapshot(version)
    version.state = state
    version.save(update_fields=["state", "updated_at"])
    version_audit(version, actor, action, before, reason, **extra)
    payload = {"type": "policy_version", "action": action, "version": version.number,
               "before": before["state"], "after": state, "actor": actor_name(actor)}
    transaction.on_commit(lambda: project_event(version.project_id, payload))


def version_locked(version_id: int) -> PolicyVersion:
    version = PolicyVersion.objects.select_for_update().filter(id=version_id).first()
    if version is None:
        raise NotFound(f"no policy version {version_id}", "Check the id (GET /api/v1/versions lists them).")
    return version



def checkpoint_store() -> Any:
    # Imported here: the store imports torch, which the web process never needs.
    from training.checkpoints.store import CheckpointStore, make_storage

    return CheckpointStore(make_storage(settings.FLYWHEEL_CHECKPOINT_DIR))


CHECKPOINT_REFUSED = "checkpoint_refused"


def version_checkpoint_refuse(version_id: int, actor: Actor, problem: str) -> None:
    """Marks a version whose checkpoint is corrupt, truncated or missing a link as failed
    (rejected, audited) in a transaction of its own: the refusal stays on record although the
    request that found it fails. A version in production or retired is left as it is (what is
    served does not change under a person's feet); the serving process refuses to load it anyway."""
    with transaction.atomic():
        version = version_locked(version_id)
        if version.state in (VersionState.CANDIDATE, VersionState.GATED, VersionState.AWAITING_APPROVAL, VersionState.CANARY):
            version_transition(version, VersionState.REJECTED, actor, CHECKPOINT_REFUSED, problem[:2000])


def version_checkpoint_verify(version: PolicyVersion) -> str | None:
    """What is wrong with the version's checkpoint (every object of its chain read back and
    checked against its hash), or None when it is whole, or when this machine's store does not
    hold the version at all (a folder-only version, or a store elsewhere): the serving process
    verifies again before it loads anything."""
    # Imported here: the checkpoint modules import torch, which only this check needs.
    from kernels.delta import CheckpointCorrupt

    store = checkpoint_store()
    if not version.manifest_hash or not store.storage.exists(version.manifest_hash):
        return None
    try:
        store.verify(version.manifest_hash)
    except CheckpointCorrupt as exc:
        return f"policy v{version.number}'s checkpoint is refused: {exc}"
    return None


def policy_folder(version: PolicyVersion) -> Path:
    """An HF folder with `version`'s weights (materialised from the store, verified, if needed). An
    adapter version's folder is its base's weights with the adapter merged in, so every engine,
    the gate and serving load it as any version's."""
    if version.adapter_base_id is not None:
        out = Path(settings.VAR_DIR) / "materialised" / f"{version.manifest_hash}-merged"
        if not (out / "config.json").exists():
            # Imported here: merging needs torch and PEFT, which the web process never loads.
            from training.rl.lora import merge_adapter

            merge_adapter(policy_folder(version.adapter_base), policy_adapter_folder(version), out)
        return out
    if version.manifest_hash:
        return _materialised(version.manifest_hash)
    if version.checkpoint_path and Path(version.checkpoint_path).is_dir():
        return Path(version.checkpoint_path)
    raise NotFound(f"policy v{version.number} has no checkpoint on this machine",
                   "Register it with a checkpoint (bootstrap_policy or a training run).")


def policy_adapter_folder(version: PolicyVersion) -> Path:
    """An adapter version's adapter alone, in PEFT's layout (adapter_model.safetensors,
    adapter_config.json): what a run goes on training, and what a LoRA-serving engine loads."""
    if version.adapter_base_id is None:
        raise Conflict(f"policy v{version.number} is full weights, not an adapter",
                       "Load its folder (policy_folder) instead.")
    return _materialised(version.manifest_hash)


def _materialised(manifest_hash: str) -> Path:
    out = Path(settings.VAR_DIR) / "materialised" / manifest_hash
    if not any(out.glob("*.json")):
        try:
            checkpoint_store().materialise(manifest_hash, out)
        except FileExistsError:  # another process materialised it meanwhile
            pass
    return out


def policy_register(
    project: Project, folder: str | Path, parent: PolicyVersion | None = None, state: str = VersionState.CANDIDATE,
    config: dict[str, Any] | None = None, adapter_base: PolicyVersion | None = None,
) -> PolicyVersion:
    """Stores the HF folder in the checkpoint store (a delta against `parent` where it has one)
    and creates the next PolicyVersion of the project. With `adapter_base`, `folder` is a PEFT
    adapter over that version's weights: only the adapter is stored, and its ratio is to the base."""
    if state not in dict(PolicyVersion.STATES):
        raise BadRequest(f"unknown policy state {state!r}", f"Use one of {[s for s, _ in PolicyVersion.STATES]}.")
    store = checkpoint_store()
    if adapter_base is not None:
        manifest_hash = store.put_adapter(str(folder), base_hash=_stored_base(store, adapter_base),
                                          meta={"project": project.slug})
    else:
        parent_hash = parent.manifest_hash if parent is not None and parent.manifest_hash else None
        manifest_hash = store.put(str(folder), parent_hash=parent_hash, meta={"project": project.slug})
    manifest = store.manifest(manifest_hash)
    raw = manifest["base_raw_bytes"] if adapter_base is not None else manifest["raw_bytes"]
    with transaction.atomic():
        Project.objects.select_for_update().filter(pk=project.pk).first()  # serialises numbering
        last = PolicyVersion.objects.filter(project=project).order_by("-number").first()
        return PolicyVersion.objects.create(
            project=project, number=(last.number if last else 0) + 1, parent=parent, state=state,
            manifest_hash=manifest_hash, delta_bytes=manifest["blob_bytes"],
            delta_ratio=manifest["blob_bytes"] / max(raw, 1), config=config or {}, adapter_base=adapter_base,
        )


def _stored_base(store: Any, base: PolicyVersion) -> str:
    """The manifest of an adapter's base weights: the base version's own (stored once; every
    adapter of it names the same objects), written to the store from its folder if it had none."""
    if base.adapter_base_id is not None:
        raise Conflict(f"policy v{base.number} is an adapter; an adapter's base is full weights",
                       f"Name its base, v{base.adapter_base.number}.")
    if base.manifest_hash:
        return str(base.manifest_hash)
    manifest_hash = store.put(str(policy_folder(base)), meta={"project": base.project.slug})
    PolicyVersion.objects.filter(pk=base.pk).update(manifest_hash=manifest_hash)
    return str(manifest_hash)
