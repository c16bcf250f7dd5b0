"""What goes into a corpus: text files from paths on disk (files, folders, globs; `.gitignore`d and
binary files skipped) or from an uploaded tar/zip archive, validated while it is read (text only,
no path traversal, no links or device files, bounded member count and uncompressed size). Pure
standard library: no Django, no torch.

    files, skipped = files_from_paths(["src/", "*.py"], Limits())
    files, skipped = files_from_archive(stream, Limits())
"""

from __future__ import annotations

import bz2
import fnmatch
import glob
import gzip
import io
import lzma
import os
import stat
import subprocess
import tarfile
import zipfile
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import IO


class CorpusRefused(ValueError):
    """Input a corpus cannot take: `message` says what, `fix` how to send it right."""

    def __init__(self, message: str, fix: str, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.fix, self.status = message, fix, status


@dataclass(frozen=True)
class Limits:
    """Bounds of one corpus: files, total bytes (uncompressed), bytes of one file (a larger file,
    usually generated or minified, is skipped), archive members (directories included)."""

    max_files: int = 20_000
    max_bytes: int = 200 * 2**20
    max_file_bytes: int = 2**20
    max_members: int = 50_000


@dataclass(frozen=True)
class TextFile:
    path: str  # relative, POSIX separators
    text: str


@dataclass
class Collected:
    """Files kept so far and what was skipped (path, why), with the running byte total."""

    limits: Limits
    files: list[TextFile] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)
    total: int = 0
    _paths: set[str] = field(default_factory=set)

    def offer(self, path: str, data: bytes) -> None:
        if path in self._paths:
            raise CorpusRefused(f"{path!r} is given twice", "Send each file once (one path, one file).")
        if len(data) > self.limits.max_file_bytes:
            self.skipped.append((path, f"larger than {self.limits.max_file_bytes:,} bytes"))
            return
        text = decode_text(data)
        if text is None:
            self.skipped.append((path, "binary (not UTF-8 text)"))
            return
        if len(self.files) >= self.limits.max_files:
            raise CorpusRefused(f"more than {self.limits.max_files:,} text files",
                                "Add a narrower set (a folder or glob), or raise FLYWHEEL_CORPUS_MAX_FILES.", 413)
        self.total += len(data)
        if self.total > self.limits.max_bytes:
            raise CorpusRefused(f"more than {self.limits.max_bytes:,} bytes of text",
                                "Add a narrower set (a folder or glob), or raise FLYWHEEL_CORPUS_MAX_BYTES.", 413)
        self.files.append(TextFile(path, text))
        self._paths.add(path)


def decode_text(data: bytes) -> str | None:
    """The text of a file, or None when it is binary: a NUL byte, or not UTF-8."""
    if b"\x00" in data:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def safe_member_path(name: str) -> str:
    """An archive member's path, relative and inside the archive, or CorpusRefused."""
    if "\x00" in name or "\\" in name:
        raise CorpusRefused(f"archive member {name!r} has a NUL or backslash in its path",
                            "Pack the files with plain relative paths (tar -czf repo.tar.gz -C REPO .).")
    if len(name) > 1000:
        raise CorpusRefused(f"archive member path {name[:60]!r}... is longer than 1,000 characters",
                            "Pack the files with shorter relative paths.")
    path = PurePosixPath(name)
    parts = [p for p in path.parts if p not in ("", ".")]
    if path.is_absolute() or ".." in parts or not parts:
        raise CorpusRefused(f"archive member {name!r} points outside the archive",
                            "Pack the files with relative paths and no '..' (tar -czf repo.tar.gz -C REPO .).")
    return "/".join(parts)


# ---------------------------------------------------------------------------------- paths on disk


def files_from_paths(paths: Sequence[str], limits: Limits) -> Collected:
    """Text files named by `paths` (files, folders walked, glob patterns), `.gitignore`d ones and
    anything inside `.git` left out; paths are kept relative to the common root of the arguments."""
    found: list[Path] = []
    for raw in paths:
        matches = [Path(m) for m in sorted(glob.glob(raw, recursive=True))] if glob.has_magic(raw) else [Path(raw)]
        if not matches or not all(m.exists() for m in matches):
            raise CorpusRefused(f"{raw!r} matches no file or folder", "Check the path (relative to where you run it).")
        for m in matches:
            found.extend(_walk(m) if m.is_dir() else [m])
    found = sorted({p.resolve() for p in found if p.is_file() and not p.is_symlink()})
    root = _common_root(found)
    ignored = _git_ignored(found)
    out = Collected(limits)
    for path in found:
        rel = path.relative_to(root).as_posix()
        if path in ignored:
            out.skipped.append((rel, ".gitignore"))
            continue
        if path.stat().st_size > limits.max_file_bytes:
            out.skipped.append((rel, f"larger than {limits.max_file_bytes:,} bytes"))
            continue
        out.offer(rel, path.read_bytes())
    return out


def _walk(folder: Path) -> Iterator[Path]:
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames[:] = sorted(d for d in dirnames if d != ".git" and not Path(dirpath, d).is_symlink())
        for name in filenames:
            yield Path(dirpath, name)


def _common_root(paths: Sequence[Path]) -> Path:
    if not paths:
        raise CorpusRefused("no files to add", "Name files, folders or globs that hold text files.")
    if len(paths) == 1:
        return paths[0].parent
    return Path(os.path.commonpath([str(p.parent) for p in paths]))


def _git_ignored(paths: Sequence[Path]) -> set[Path]:
    """The paths git would ignore (`git check-ignore`, per repository); outside a repository, the
    `.gitignore` files of the folders above each path, read with fnmatch (no negations)."""
    ignored: set[Path] = set()
    by_repo: dict[Path | None, list[Path]] = {}
    for p in paths:
        by_repo.setdefault(_repo_of(p.parent), []).append(p)
    for repo, members in by_repo.items():
        if repo is None:
            ignored |= {p for p in members if _plain_ignored(p)}
            continue
        proc = subprocess.run(["git", "-C", str(repo), "check-ignore", "--stdin", "-z"], check=False,
                              input="\0".join(str(p) for p in members).encode(), capture_output=True)
        ignored |= {Path(n).resolve() for n in proc.stdout.decode(errors="replace").split("\0") if n}
    return ignored


def _repo_of(folder: Path) -> Path | None:
    for parent in (folder, *folder.parents):
        if (parent / ".git").exists():
            return parent
    return None


def _plain_ignored(path: Path) -> bool:
    for parent in path.parents:
        rules = parent / ".gitignore"
        if not rules.is_file():
            continue
        rel = path.relative_to(parent).as_posix()
        for line in rules.read_text(errors="replace").splitlines():
            rule = line.strip()
            if not rule or rule.startswith(("#", "!")):
                continue
            rule = rule.rstrip("/").lstrip("/")
            if fnmatch.fnmatch(rel, rule) or any(fnmatch.fnmatch(part, rule) for part in rel.split("/")):
                return True
    return False


# ---------------------------------------------------------------------------------- archives


class BoundedReader(io.RawIOBase):
    """A stream that refuses to yield more than `limit` bytes: the decompressed archive is counted
    as it is read, so a bomb stops at the limit instead of filling memory or disk."""

    def __init__(self, raw: IO[bytes], limit: int) -> None:
        self.raw, self.limit, self.read_so_far = raw, limit, 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:  # noqa: ANN001 - io's buffer protocol
        data = self.raw.read(len(buffer))
        self.read_so_far += len(data)
        if self.read_so_far > self.limit:
            raise CorpusRefused(f"the archive unpacks to more than {self.limit:,} bytes",
                                "Send a smaller archive (only the sources), or raise FLYWHEEL_CORPUS_MAX_BYTES.", 413)
        buffer[: len(data)] = data
        return len(data)


def files_from_archive(stream: IO[bytes], limits: Limits) -> Collected:
    """Text files of a tar (plain, gz, bz2, xz) or zip archive; refused whole on a hostile member."""
    head = stream.read(6)
    stream.seek(0)
    if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
        return _from_zip(stream, limits)
    opener = _decompressor(head)
    # the tar stream's headers, padding and PAX records count too: twice the text limit bounds them
    bounded = io.BufferedReader(BoundedReader(opener(stream), 2 * limits.max_bytes + 2**20))
    return _from_tar(bounded, limits)


def _decompressor(head: bytes):  # -> Callable[[IO[bytes]], IO[bytes]]
    if head.startswith(b"\x1f\x8b"):
        return lambda s: gzip.GzipFile(fileobj=s, mode="rb")
    if head.startswith(b"BZh"):
        return lambda s: bz2.BZ2File(s, mode="rb")
    if head.startswith(b"\xfd7zXZ"):
        return lambda s: lzma.LZMAFile(s, mode="rb")
    return lambda s: s


def _from_tar(stream: IO[bytes], limits: Limits) -> Collected:
    out = Collected(limits)
    members = 0
    try:
        with tarfile.open(fileobj=stream, mode="r|") as tar:
            for member in tar:
                members += 1
                _member_count_check(members, limits)
                path = safe_member_path(member.name)
                if member.isdir():
                    continue
                if not member.isreg():
                    raise CorpusRefused(f"archive member {path!r} is a {_tar_kind(member)}, not a regular file",
                                        "Send only regular files (tar --dereference, or drop links and devices).")
                if member.size > limits.max_file_bytes:
                    out.skipped.append((path, f"larger than {limits.max_file_bytes:,} bytes"))
                    continue
                handle = tar.extractfile(member)
                out.offer(path, handle.read(limits.max_file_bytes + 1) if handle else b"")
    except (tarfile.TarError, EOFError, OSError, lzma.LZMAError, zlib.error) as exc:
        raise CorpusRefused(f"the upload is not a readable tar or zip archive ({type(exc).__name__}: {exc})",
                            "Send a .tar, .tar.gz, .tar.bz2, .tar.xz or .zip archive, or text files.") from None
    return out


def _tar_kind(member: tarfile.TarInfo) -> str:
    if member.issym() or member.islnk():
        return "link"
    if member.ischr() or member.isblk():
        return "device file"
    return "special file"


def _member_count_check(members: int, limits: Limits) -> None:
    if members > limits.max_members:
        raise CorpusRefused(f"the archive has more than {limits.max_members:,} members",
                            "Send only the sources, or raise FLYWHEEL_CORPUS_MAX_FILES.", 413)


def _from_zip(stream: IO[bytes], limits: Limits) -> Collected:
    out = Collected(limits)
    try:
        with zipfile.ZipFile(stream) as zf:
            infos = zf.infolist()
            _member_count_check(len(infos), limits)
            declared = sum(i.file_size for i in infos)
            if declared > 2 * limits.max_bytes:
                raise CorpusRefused(f"the archive unpacks to {declared:,} bytes (more than {limits.max_bytes:,})",
                                    "Send only the sources, or raise FLYWHEEL_CORPUS_MAX_BYTES.", 413)
            for info in infos:
                _zip_member(zf, info, out, limits)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, OSError, zlib.error, NotImplementedError) as exc:
        raise CorpusRefused(f"the upload is not a readable zip archive ({type(exc).__name__}: {exc})",
                            "Send a .zip made by `zip -r` (stored or deflated), or a tar archive.") from None
    return out


def _zip_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, out: Collected, limits: Limits) -> None:
    path = safe_member_path(info.filename)
    mode = info.external_attr >> 16
    if info.is_dir():
        return
    if mode and not stat.S_ISREG(mode):
        kind = "link" if stat.S_ISLNK(mode) else "special file"
        raise CorpusRefused(f"archive member {path!r} is a {kind}, not a regular file",
                            "Send only regular files (zip without --symlinks).")
    if info.file_size > limits.max_file_bytes:
        out.skipped.append((path, f"larger than {limits.max_file_bytes:,} bytes"))
        return
    with zf.open(info) as handle:  # reads at most the declared size, CRC-checked
        out.offer(path, handle.read(limits.max_file_bytes + 1))


def files_from_uploads(uploads: Iterable[tuple[str, bytes]], limits: Limits) -> Collected:
    """Text files sent one by one (multipart), each name checked as an archive member's would be."""
    out = Collected(limits)
    for count, (name, data) in enumerate(uploads, start=1):
        _member_count_check(count, limits)
        out.offer(safe_member_path(name), data)
    return out
