"""Corpora: files from disk and from uploads, hostile archives refused while they are read, the
held-out slice fixed by path, blobs stored once.

    .venv/bin/python -m pytest tests/training/corpora/test_corpora.py -q
"""

from __future__ import annotations

import gzip
import io
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest
from django.core.management import CommandError, call_command

from feedback.services import api_key_create, service_account_get
from tests.factories import member
from training.corpora.files import CorpusRefused, Limits, files_from_archive
from training.corpora.selectors import corpus_heldout_texts, corpus_texts
from training.corpora.services import corpus_add_paths, heldout_bucket, heldout_paths
from training.corpora.store import blob_path
from training.models import Corpus, CorpusFile

SMALL = Limits(max_files=50, max_bytes=64 * 1024, max_file_bytes=4096, max_members=60)


@pytest.fixture
def corpus_dir(settings, tmp_path):
    settings.FLYWHEEL_CORPUS_DIR = tmp_path / "store"
    return settings.FLYWHEEL_CORPUS_DIR


def _tar(members: list[tuple[tarfile.TarInfo, bytes | None]], mode: str = "w:gz") -> io.BytesIO:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=mode) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    buf.seek(0)
    return buf


def _member(name: str, kind: bytes = tarfile.REGTYPE, **kw) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    for k, v in kw.items():
        setattr(info, k, v)
    return info


# ---------------------------------------------------------------------------------- archives


def test_a_tar_gz_of_sources_gives_its_text_files_and_skips_binaries():
    archive = _tar([(_member("pkg/a.py"), b"def a():\n    return 1\n"), (_member("pkg", tarfile.DIRTYPE), None),
                    (_member("pkg/logo.png"), b"\x89PNG\r\n\x1a\n\x00\x00"), (_member("big.py"), b"x" * 5000)])
    out = files_from_archive(archive, SMALL)
    assert [f.path for f in out.files] == ["pkg/a.py"]
    assert dict(out.skipped) == {"pkg/logo.png": "binary (not UTF-8 text)", "big.py": "larger than 4,096 bytes"}


@pytest.mark.parametrize("name", ["../etc/passwd", "/etc/passwd", "pkg/../../x.py", "a\\..\\b.py"])
def test_a_member_outside_the_archive_is_refused_with_the_fix(name):
    with pytest.raises(CorpusRefused) as caught:
        files_from_archive(_tar([(_member(name), b"x = 1\n")]), SMALL)
    assert "outside the archive" in caught.value.message or "backslash" in caught.value.message
    assert "relative" in caught.value.fix and caught.value.status == 400


@pytest.mark.parametrize("kind, what", [(tarfile.SYMTYPE, "link"), (tarfile.LNKTYPE, "link"),
                                        (tarfile.CHRTYPE, "device file"), (tarfile.BLKTYPE, "device file"),
                                        (tarfile.FIFOTYPE, "special file")])
def test_links_and_device_files_in_a_tar_are_refused(kind, what):
    info = _member("pkg/evil", kind, linkname="/etc/passwd")
    with pytest.raises(CorpusRefused, match=f"is a {what}"):
        files_from_archive(_tar([(_member("ok.py"), b"x = 1\n"), (info, None)]), SMALL)


def test_a_gzip_bomb_stops_at_the_bound_while_streaming():
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        info = _member("bomb.py")
        info.size = 10 * 2**20  # 10 MiB of zeros in one member, ~10 KiB compressed
        tar.addfile(info, io.BytesIO(b"\0" * info.size))
    packed = gzip.compress(raw.getvalue())
    assert len(packed) < 64 * 1024
    with pytest.raises(CorpusRefused) as caught:
        files_from_archive(io.BytesIO(packed), SMALL)
    assert caught.value.status == 413 and "unpacks to more than" in caught.value.message


def test_an_archive_of_too_many_members_is_refused():
    members = [(_member(f"d{i}", tarfile.DIRTYPE), None) for i in range(SMALL.max_members + 1)]  # empty folders
    with pytest.raises(CorpusRefused, match="more than 60 members"):
        files_from_archive(_tar(members), SMALL)


def test_a_member_given_twice_is_refused():
    with pytest.raises(CorpusRefused, match="given twice"):
        files_from_archive(_tar([(_member("a.py"), b"x = 1\n"), (_member("./a.py"), b"y = 2\n")]), SMALL)


def _zip(entries: list[tuple[str, bytes, int]]) -> io.BytesIO:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data, mode in entries:
            info = zipfile.ZipInfo(name)
            info.external_attr = mode << 16
            zf.writestr(info, data)
    buf.seek(0)
    return buf


def test_a_zip_with_a_symlink_or_traversal_is_refused_and_a_plain_one_is_read():
    with pytest.raises(CorpusRefused, match="is a link"):
        files_from_archive(_zip([("a.py", b"x = 1\n", 0o100644), ("l", b"/etc/passwd", 0o120777)]), SMALL)
    with pytest.raises(CorpusRefused, match="outside the archive"):
        files_from_archive(_zip([("../a.py", b"x = 1\n", 0o100644)]), SMALL)
    out = files_from_archive(_zip([("src/a.py", b"x = 1\n", 0o100644), ("src/b.bin", b"\0\1", 0o100644)]), SMALL)
    assert [f.path for f in out.files] == ["src/a.py"] and out.skipped == [("src/b.bin", "binary (not UTF-8 text)")]


def test_a_zip_bomb_is_refused_from_its_declared_sizes():
    entries = [(f"z{i}.py", b"\0" * 60_000, 0o100644) for i in range(3)]
    with pytest.raises(CorpusRefused) as caught:
        files_from_archive(_zip(entries), SMALL)
    assert caught.value.status == 413


def test_bytes_that_are_no_archive_are_refused_with_what_to_send():
    with pytest.raises(CorpusRefused) as caught:
        files_from_archive(io.BytesIO(b"this is not an archive at all" * 30), SMALL)
    assert ".tar.gz" in caught.value.fix


# ---------------------------------------------------------------------------------- held-out slice


def test_the_held_out_slice_is_fixed_by_path_and_never_empty():
    paths = [f"pkg/m{i}.py" for i in range(200)]
    held = heldout_paths(paths, 10)
    assert held == {p for p in paths if heldout_bucket(p) < 10}
    assert 8 <= len(held) <= 35  # about a tenth
    assert heldout_paths(paths[:100], 10) == held & set(paths[:100])  # a file's fate is its own
    assert len(heldout_paths(["a.py", "b.py"], 10)) == 1  # two files: one each way


# ---------------------------------------------------------------------------------- from disk


def _repo(root: Path) -> Path:
    (root / "src").mkdir(parents=True)
    for i in range(30):
        (root / "src" / f"mod{i}.py").write_text(f"def f{i}(x):\n    return x + {i}\n")
    (root / "src" / "same.py").write_text("def f0(x):\n    return x + 0\n")  # the bytes of mod0.py
    (root / "build").mkdir()
    (root / "build" / "gen.py").write_text("generated = True\n")
    (root / "image.png").write_bytes(b"\x89PNG\0\0\0")
    (root / ".gitignore").write_text("build/\n")
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    return root


def test_corpus_add_skips_ignored_and_binary_files_and_stores_each_blob_once(creds, corpus_dir, tmp_path):
    repo = _repo(tmp_path / "repo")
    call_command("corpus", "add", "--project", creds.project.slug, str(repo))
    corpus = Corpus.objects.get(project=creds.project)
    paths = set(CorpusFile.objects.filter(corpus=corpus).values_list("path", flat=True))
    assert "build/gen.py" not in paths and "image.png" not in paths
    assert {"src/mod0.py", "src/same.py", ".gitignore"} <= paths
    assert dict(corpus.skipped) == {"build/gen.py": ".gitignore", "image.png": "binary (not UTF-8 text)"}
    shas = list(CorpusFile.objects.filter(corpus=corpus, path__in=["src/mod0.py", "src/same.py"])
                .values_list("sha256", flat=True))
    assert shas[0] == shas[1] and blob_path(shas[0]).read_text() == "def f0(x):\n    return x + 0\n"
    held, train = corpus_texts(corpus, heldout=True), corpus_texts(corpus, heldout=False)
    assert held and train and not {p for p, _ in held} & {p for p, _ in train}
    assert corpus_heldout_texts(creds.project) == held
    assert corpus.tokens is None  # no policy yet to count with


def test_a_glob_adds_only_its_matches_and_limits_are_clear_errors(creds, corpus_dir, tmp_path, settings):
    repo = _repo(tmp_path / "repo")
    corpus = corpus_add_paths(creds.project, [str(repo / "src" / "mod1*.py")])
    assert sorted(corpus.files.values_list("path", flat=True)) == [f"mod1{s}.py" for s in ["", *map(str, range(10))]]
    settings.FLYWHEEL_CORPUS_MAX_FILES = 5
    with pytest.raises(CommandError, match="more than 5 text files.*FLYWHEEL_CORPUS_MAX_FILES"):
        call_command("corpus", "add", "--project", creds.project.slug, str(repo / "src"))
    with pytest.raises(CommandError, match="matches no file"):
        call_command("corpus", "add", "--project", creds.project.slug, str(repo / "nothing-here"))


def test_token_counts_use_the_production_tokenizer(creds, corpus_dir, tmp_path, production, tokenizer):
    repo = _repo(tmp_path / "repo")
    corpus = corpus_add_paths(creds.project, [str(repo / "src")])
    text = (repo / "src" / "mod3.py").read_text()
    assert corpus.files.get(path="mod3.py").tokens == len(tokenizer(text, add_special_tokens=False)["input_ids"])
    assert corpus.tokens == sum(corpus.files.values_list("tokens", flat=True)) and corpus.tokenizer_version == 1


# ---------------------------------------------------------------------------------- the API


@pytest.fixture
def admin_key(creds) -> str:
    return api_key_create(creds.project, ["admin"], name="ops",
                          owner=member(service_account_get("ops"), creds.project, "admin"))


def _post(client, body: bytes, key: str, content_type: str = "application/gzip", query: str = "?name=repo"):
    return client.generic("POST", f"/api/v1/corpora{query}", body, content_type=content_type,
                          HTTP_AUTHORIZATION=f"Bearer {key}")


def test_an_admin_key_uploads_a_tar_gz_and_lists_it(client, creds, corpus_dir, admin_key):
    archive = _tar([(_member(f"pkg/m{i}.py"), f"value_{i} = {i}\n".encode()) for i in range(20)])
    response = _post(client, archive.getvalue(), admin_key)
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["files"] == 20 and body["name"] == "repo" and 1 <= body["heldout_files"] < 20
    listed = client.get("/api/v1/corpora", HTTP_AUTHORIZATION=f"Bearer {admin_key}").json()["results"]
    assert [c["id"] for c in listed] == [body["id"]]


def test_the_upload_refuses_hostile_or_wrong_input_with_the_fix(client, creds, corpus_dir, admin_key, settings):
    read_key = api_key_create(creds.project, ["read"], name="reader")
    ok = _tar([(_member("a.py"), b"x = 1\n")]).getvalue()
    assert _post(client, ok, read_key).status_code == 403
    traversal = _post(client, _tar([(_member("../../etc/cron.d/x"), b"x = 1\n")]).getvalue(), admin_key)
    assert traversal.status_code == 400 and "relative" in traversal.json()["error"]["fix"]
    link = _post(client, _tar([(_member("l", tarfile.SYMTYPE, linkname="/etc/passwd"), None)]).getvalue(), admin_key)
    assert link.status_code == 400 and "link" in link.json()["error"]["message"]
    wrong = _post(client, b"x = 1\n", admin_key, content_type="text/plain")
    assert wrong.status_code == 400 and "multipart" in wrong.json()["error"]["fix"]
    assert _post(client, b"garbage" * 50, admin_key).status_code == 400
    settings.FLYWHEEL_CORPUS_UPLOAD_MAX_BYTES = 100
    too_big = _post(client, ok + b"\0" * 200, admin_key)
    assert too_big.status_code == 413 and "FLYWHEEL_CORPUS_UPLOAD_MAX_BYTES" in too_big.json()["error"]["fix"]
    assert not Corpus.objects.exists()


def test_text_files_upload_as_multipart_and_a_binary_alone_is_a_400(client, creds, corpus_dir, admin_key):
    from django.core.files.uploadedfile import SimpleUploadedFile

    files = [SimpleUploadedFile("a.py", b"def a():\n    pass\n"), SimpleUploadedFile("b.py", b"b = 2\n")]
    response = client.post("/api/v1/corpora", {"files": files}, HTTP_AUTHORIZATION=f"Bearer {admin_key}")
    assert response.status_code == 201, response.json()
    assert response.json()["files"] == 2
    binary = client.post("/api/v1/corpora", {"files": [SimpleUploadedFile("x.bin", b"\0\1\2")]},
                         HTTP_AUTHORIZATION=f"Bearer {admin_key}")
    assert binary.status_code == 400 and "binary" in binary.json()["error"]["message"]


def test_the_corpora_page_lists_counts_for_members_only(client, creds, corpus_dir, tmp_path, bob, charlie,
                                                         django_assert_max_num_queries):
    repo = _repo(tmp_path / "repo")
    corpus_add_paths(creds.project, [str(repo / "src")], name="our code")
    corpus_add_paths(creds.project, [str(repo / "src" / "mod1*.py")], name="some")
    client.force_login(bob)  # a viewer
    with django_assert_max_num_queries(8):
        page = client.get(f"/p/{creds.project.slug}/corpora/")
    assert page.status_code == 200
    html = page.content.decode()
    assert "our code" in html and "31" in html and "% by path" in html
    client.force_login(charlie)  # no member of acme
    assert client.get(f"/p/{creds.project.slug}/corpora/").status_code == 404
