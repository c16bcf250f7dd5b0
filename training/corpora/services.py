"""Writes of corpora: files stored content-addressed (a blob per SHA-256 under FLYWHEEL_CORPUS_DIR),
the held-out slice fixed by each path's hash, file and token counts.

    .venv/bin/python manage.py corpus add --project SLUG src/ 'lib/**/*.py'
    .venv/bin/python -m pytest tests/training/corpora/test_corpora.py -q
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import IO, Any

from django.conf import settings
from django.db import transaction

from core.errors import ApplicationError, BadRequest, PayloadTooLarge
from feedback.models import Project
from training.corpora import files as corpus_files
from training.corpora.files import Collected, CorpusRefused, Limits, TextFile
from training.corpora.lines import continuation_prompts, heldout_bucket, heldout_paths  # noqa: F401 - re-exported
from training.corpora.selectors import corpus_texts
from training.corpora.store import blob_put
from training.models import Corpus, CorpusFile, EvalSuite
from training.versions.selectors import policy_production
from training.versions.services import policy_folder

DEFAULT_HELDOUT_PERCENT = 10
MAX_SKIPPED_KEPT = 200


def corpus_limits() -> Limits:
    return Limits(max_files=settings.FLYWHEEL_CORPUS_MAX_FILES, max_bytes=settings.FLYWHEEL_CORPUS_MAX_BYTES,
                  max_file_bytes=settings.FLYWHEEL_CORPUS_MAX_FILE_BYTES,
                  max_members=2 * settings.FLYWHEEL_CORPUS_MAX_FILES + 1000)


def refused(exc: CorpusRefused) -> ApplicationError:
    """The one error path's form of a refusal (413 for a bound, 400 otherwise)."""
    return (PayloadTooLarge if exc.status == 413 else BadRequest)(exc.message, exc.fix)


def corpus_create(project: Project, collected: Collected, *, name: str, created_by: Any = None,
                  heldout_percent: int = DEFAULT_HELDOUT_PERCENT) -> Corpus:
    """A corpus of the collected text files (none is an error that says what was skipped)."""
    if not collected.files:
        why = "; ".join(f"{p}: {w}" for p, w in collected.skipped[:5]) or "nothing was given"
        raise BadRequest(f"no text file to add ({why})", "Give UTF-8 text files (sources), not binaries or ignored files.")
    if not 0 <= heldout_percent <= 50:
        raise BadRequest(f"heldout_percent must be in [0, 50], got {heldout_percent}", "E.g. 10.")
    held = heldout_paths([f.path for f in collected.files], heldout_percent)
    counter, version = _token_counter(project)
    rows = [_file_row(f, f.path in held, counter) for f in collected.files]
    with transaction.atomic():
        corpus = Corpus.objects.create(
            project=project, name=name[:200], heldout_percent=heldout_percent, files_count=len(rows),
            bytes=sum(r.bytes for r in rows), tokenizer_version=version, created_by=created_by,
            tokens=sum(r.tokens for r in rows) if counter else None,
            heldout_tokens=sum(r.tokens for r in rows if r.heldout) if counter else None,
            skipped=[list(s) for s in collected.skipped[:MAX_SKIPPED_KEPT]],
        )
        for row in rows:
            row.corpus = corpus
        CorpusFile.objects.bulk_create(rows, batch_size=1000)
    return corpus


def _file_row(f: TextFile, heldout: bool, counter: Any) -> CorpusFile:
    data = f.text.encode()
    return CorpusFile(path=f.path[:1000], sha256=blob_put(data), bytes=len(data), lines=f.text.count("\n") + 1,
                      tokens=counter(f.text) if counter else None, heldout=heldout)


def _token_counter(project: Project) -> tuple[Any, int | None]:
    """Token counts under the production policy's tokenizer (None before the project has one)."""
    production = policy_production(project)
    if production is None:
        return None, None
    # Imported here: transformers is heavy and only needed once a policy exists.
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(policy_folder(production)))
    return (lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])), production.number


def corpus_add_paths(project: Project, paths: Sequence[str], *, name: str | None = None, created_by: Any = None,
                     heldout_percent: int = DEFAULT_HELDOUT_PERCENT) -> Corpus:
    """`manage.py corpus add`: files, folders and globs on this machine."""
    try:
        collected = corpus_files.files_from_paths(paths, corpus_limits())
    except CorpusRefused as exc:
        raise refused(exc) from None
    return corpus_create(project, collected, name=name or " ".join(paths), created_by=created_by,
                         heldout_percent=heldout_percent)


def corpus_add_upload(project: Project, *, archive: IO[bytes] | None = None,
                      uploads: Sequence[tuple[str, bytes]] = (), name: str = "upload", created_by: Any = None,
                      heldout_percent: int = DEFAULT_HELDOUT_PERCENT) -> Corpus:
    """POST /api/v1/corpora: a tar/zip archive, or text files sent one by one."""
    try:
        collected = (corpus_files.files_from_archive(archive, corpus_limits()) if archive is not None
                     else corpus_files.files_from_uploads(uploads, corpus_limits()))
    except CorpusRefused as exc:
        raise refused(exc) from None
    return corpus_create(project, collected, name=name, created_by=created_by, heldout_percent=heldout_percent)


def eval_suite_from_corpus(corpus: Corpus, prompts: int = 64, seed: int = 0) -> EvalSuite:
    """A new version of the project's default eval suite: `prompts` line prefixes of the corpus's
    held-out files (a few characters to half the line, the gate's cut), for a project that has no
    suite of its own yet. Each prompt carries what was written next (`rest`): the suite is scored
    by `intent_match` (the share of the line a tab-completion user would have kept), and the
    gate's matched-characters row reads the same."""
    held = continuation_prompts(corpus_texts(corpus, heldout=True), n=prompts, seed=seed)
    if not held:
        raise BadRequest(f"corpus {corpus.pk} has no held-out line to make a suite of",
                         "Add a corpus of more files (a tenth of them is held out).")
    last = EvalSuite.objects.filter(project=corpus.project, name="default").order_by("-version").first()
    return EvalSuite.objects.create(
        project=corpus.project, name="default", version=(last.version if last else 0) + 1,
        prompts=[{"id": f"corpus-{corpus.pk}-{i}", "prompt": p.prompt, "context": {"prefix": p.prompt, "rest": p.rest}}
                 for i, p in enumerate(held)], checks=[{"name": "intent_match", "weight": 1.0}],
        n_samples=2, max_tokens=16)
