"""python manage.py bootstrap_policy --project SLUG [--task tab-completion] [--steps 1000 | --seconds 60]
    [--kind dense|moe]
python manage.py bootstrap_policy --project SLUG --from PATH     # any local HF causal LM folder

Builds the demo's base policy offline (a byte-level BPE tokenizer and a tiny causal LM, trained on
lines of this machine's Python standard library), pretrains it with a progress bar, and registers
it as the project's first policy version, in production. With `--from PATH`, a local Hugging Face
folder (Qwen2/Qwen3/Qwen3-MoE/Llama, safetensors, its own tokenizer and chat template; see
training/checkpoints/hf_folder.py) is registered instead, through the same checkpoint store. `--steps` bounds pretraining by optimiser
steps (the same base on every machine, however busy); `--seconds` by wall time.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from feedback.models import Project
from training.checkpoints.hf_folder import FolderRefused, hf_folder_check
from training.models import PolicyVersion, VersionState
from training.pretrain import PolicyConfig, build_policy, pretrain, stdlib_corpus
from training.promotion.services import base_policy_install
from training.versions.services import policy_register


class Command(BaseCommand):
    help = "Pretrain the base policy on stdlib sources and register it as version 1 (production)."

    def add_arguments(self, parser):
        parser.add_argument("--project", default="demo")
        parser.add_argument("--task", default="tab-completion")
        parser.add_argument("--seconds", type=float, default=60.0)
        parser.add_argument("--steps", type=int, default=None,
                            help="pretrain for this many optimiser steps (wins over --seconds)")
        parser.add_argument("--kind", choices=["dense", "moe"], default="dense")
        parser.add_argument("--force", action="store_true", help="replace an existing production policy")
        parser.add_argument("--from", dest="source", default=None,
                            help="register this local Hugging Face model folder instead of pretraining")
        parser.add_argument("--no-cache", action="store_true", help="pretrain again even if var/ holds this base")

    def handle(self, *args, **opts):

        project = Project.objects.filter(slug=opts["project"]).first()
        if project is None:
            raise CommandError(f"no project {opts['project']!r}: create it with manage.py create_project")
        existing = PolicyVersion.objects.filter(project=project).order_by("-number").first()
        if existing is not None and not opts["force"]:
            self.stdout.write(f"{project.slug} already has policy v{existing.number} ({existing.state}); "
                              "use --force to build a new base")
            return
        if opts["source"]:
            self._from_folder(project, Path(opts["source"]), opts)
            return
        folder = Path(settings.VAR_DIR) / "policies" / project.slug / f"base-{opts['kind']}"
        steps = opts["steps"]
        budget = f"{steps}steps" if steps else f"{opts['seconds']:g}s"
        seconds = float("inf") if steps else opts["seconds"]
        cached = Path(settings.VAR_DIR) / "policies" / "pretrained" / f"{opts['kind']}-{budget}"
        if (cached / "pretrain.json").exists() and not opts["no_cache"]:
            # Pretraining is the slow part and depends only on the kind and budget: reuse it.
            self.stdout.write(f"reusing the {opts['kind']} base pretrained {budget} in {cached}")
            shutil.rmtree(folder, ignore_errors=True)
            shutil.copytree(cached, folder)
            stats = json.loads((cached / "pretrain.json").read_text())
        else:
            corpus = stdlib_corpus()
            self.stdout.write(f"building a {opts['kind']} policy from {len(corpus)} stdlib lines in {folder}")
            build_policy(folder, PolicyConfig(kind=opts["kind"]), corpus[:60_000])
            stats = pretrain(folder, corpus, seconds, progress=_progress_bar(seconds, steps), max_steps=steps)
            sys.stdout.write("\n")
            (folder / "pretrain.json").write_text(json.dumps(stats))
            shutil.rmtree(cached, ignore_errors=True)
            shutil.copytree(folder, cached)
        version = _register(project, folder, opts, stats, budget)
        self.stdout.write(f"registered {project.slug} v{version.number} in production "
                          f"({int(stats['step'])} steps, loss {stats['loss']:.3f})")


    def _from_folder(self, project, folder: Path, opts: dict) -> None:
        try:
            config = hf_folder_check(folder)
        except FolderRefused as exc:
            raise CommandError(f"{exc.message}. {exc.fix}") from None
        kind = "moe" if config["model_type"] == "qwen3_moe" else "dense"
        version = policy_register(project, folder, parent=None, state=VersionState.CANDIDATE,
                                  config={"task": opts["task"], "kind": kind, "source": str(folder.resolve()),
                                          "model_type": config["model_type"]})
        version = base_policy_install(version, "system:bootstrap_policy", f"base policy from {folder.resolve()}")
        self.stdout.write(f"registered {project.slug} v{version.number} in production from {folder} "
                          f"({config['model_type']})")


def _progress_bar(seconds: float, steps: int | None = None):
    def show(stats: dict[str, float]) -> None:
        done = min(stats["step"] / steps if steps else stats["elapsed"] / max(seconds, 1e-9), 1.0)
        bar = "#" * int(done * 30)
        sys.stdout.write(f"\r[{bar:<30}] {done:4.0%} step {int(stats['step'])} loss {stats['loss']:.3f}")
        sys.stdout.flush()

    return show


def _register(project, folder: Path, opts: dict, stats: dict, budget: str):

    version = policy_register(project, folder, parent=None, state=VersionState.CANDIDATE,
                              config={"task": opts["task"], "kind": opts["kind"], "pretrain": stats})
    return base_policy_install(version, "system:bootstrap_policy",
                               f"base policy pretrained {budget} on stdlib sources")
