"""Reads of corpora: a project's corpora, one corpus's training or held-out texts and lines, the
names its code uses (for the invented-name rule of training/rewards/usefulness.py).

`corpus_heldout_texts(project)` is what the gate's rows read: the held-out files of the project's
newest corpus (never trained on, never used for replay rollouts)."""

from __future__ import annotations

from functools import lru_cache

from django.db.models import Count, Q, QuerySet

from core.errors import NotFound
from feedback.models import Project
from training.corpora.store import blob_text
from training.models import Corpus, CorpusFile
from training.rewards.usefulness import known_names


def corpus_list(project: Project) -> QuerySet[Corpus]:
    return Corpus.objects.filter(project=project).order_by("-created_at", "-id")


def corpus_rows(project: Project) -> QuerySet[Corpus]:
    """The corpora page: newest first, each with its held-out file count (one query)."""
    return corpus_list(project).annotate(heldout_files=Count("files", filter=Q(files__heldout=True)))


def corpus_latest(project: Project) -> Corpus | None:
    return corpus_list(project).first()


def corpus_get(project: Project, corpus_id: int | None = None) -> Corpus:
    """The project's corpus `corpus_id` (another project's is a 404, like one that does not exist),
    or its newest when None."""
    corpus = corpus_latest(project) if corpus_id is None else corpus_list(project).filter(pk=corpus_id).first()
    if corpus is None:
        what = f"corpus {corpus_id}" if corpus_id is not None else "corpus"
        raise NotFound(f"project {project.slug!r} has no {what}",
                       "Add one: manage.py corpus add --project SLUG PATH... (or POST /api/v1/corpora).")
    return corpus


@lru_cache(maxsize=4096)
def _blob_text(sha: str) -> str:  # a blob never changes: its name is its hash
    return blob_text(sha)


def corpus_texts(corpus: Corpus, heldout: bool) -> list[tuple[str, str]]:
    """(path, text) of the corpus's training files (heldout=False) or held-out files, by path."""
    rows = CorpusFile.objects.filter(corpus=corpus, heldout=heldout).order_by("path").values_list("path", "sha256")
    return [(path, _blob_text(sha)) for path, sha in rows]


def corpus_heldout_texts(project: Project, corpus_id: int | None = None) -> list[tuple[str, str]]:
    """The held-out slice of the project's newest corpus (or `corpus_id`): [] without a corpus."""
    try:
        corpus = corpus_get(project, corpus_id)
    except NotFound:
        return []
    return corpus_texts(corpus, heldout=True)


def corpus_lines(texts: list[tuple[str, str]], min_chars: int = 8) -> list[str]:
    """The stripped lines of at least `min_chars` characters, in file then line order."""
    return [s for _, text in texts for line in text.splitlines() if len(s := line.strip()) >= min_chars]


def corpus_known_names(corpus: Corpus) -> frozenset[str]:
    """Every identifier the corpus's files use, plus the language's (usefulness.known_names)."""
    return known_names(text for _, text in corpus_texts(corpus, False) + corpus_texts(corpus, True))
