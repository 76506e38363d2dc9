"""`mlxgw models pull`: a model from the Hugging Face hub (or a mirror: HF_ENDPOINT), through
huggingface_hub (its cache, resumable downloads, HF_TOKEN, progress bars).

An MLX repository (config.json + .safetensors) is referenced in place: the models-dir
folder holds symlinks into the hub cache's snapshot, no second copy. A GGUF repository
gives one .gguf (--file picks it; a split GGUF brings all its parts), converted by the
usual GGUF import."""

from __future__ import annotations

import fnmatch
import time
from dataclasses import dataclass
from pathlib import Path

from ...shared import model_store
from .gguf.importer import ImportError_, ImportResult, import_gguf

# Files an MLX model folder needs (weights, configs, tokenizer, template); nothing executable.
MLX_PATTERNS = ("*.safetensors", "*.json", "*.txt", "*.model", "*.tiktoken", "*.jinja")


@dataclass(frozen=True)
class RepoSpec:
    repo_id: str
    revision: str | None

    @classmethod
    def parse(cls, spec: str) -> RepoSpec:
        repo_id, _, revision = spec.partition("@")
        parts = repo_id.split("/")
        if len(parts) != 2 or not all(parts) or any(p in (".", "..") for p in parts):
            raise ImportError_(f"{spec!r} is not a hub repository: use ORG/NAME or ORG/NAME@REVISION")
        return cls(repo_id, revision or None)


def _hub_errors():
    from huggingface_hub import errors

    return errors


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def _explain(e: Exception, spec: RepoSpec) -> ImportError_:
    errors = _hub_errors()
    where = _endpoint()
    if isinstance(e, errors.GatedRepoError):
        return ImportError_(f"{spec.repo_id} is gated: accept its terms on the hub, then set HF_TOKEN")
    if isinstance(e, errors.RevisionNotFoundError):
        return ImportError_(f"{spec.repo_id} has no revision {spec.revision!r} on {where}")
    if isinstance(e, errors.RepositoryNotFoundError):
        return ImportError_(f"repository {spec.repo_id} not found on {where} (private? set HF_TOKEN)")
    if isinstance(e, errors.HfHubHTTPError):
        return ImportError_(f"the hub at {where} answered an error for {spec.repo_id}: {str(e).splitlines()[0]}")
    return ImportError_(
        f"cannot reach the hub at {where} ({type(e).__name__}): no network? Set HF_ENDPOINT to a mirror, "
        "or import a local file with `mlxgw models import`"
    )


def _repo_files(spec: RepoSpec) -> tuple[str, list[str]]:
    """(commit sha, file names) of the repository at the revision."""
    from huggingface_hub import HfApi

    try:
        info = HfApi().model_info(spec.repo_id, revision=spec.revision)
    except Exception as e:  # every hub or network failure becomes one message
        raise _explain(e, spec) from None
    return info.sha, [s.rfilename for s in info.siblings or []]


def _download(spec: RepoSpec, sha: str, filename: str) -> Path:
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(spec.repo_id, filename, revision=sha))
    except Exception as e:
        raise _explain(e, spec) from None


def _pick_gguf(files: list[str], wanted: str | None, repo_id: str) -> list[str]:
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if wanted:
        if wanted not in files:
            raise ImportError_(f"{repo_id} has no file {wanted!r}; its .gguf files: {', '.join(ggufs) or 'none'}")
        chosen = wanted
    elif len([f for f in ggufs if "-of-" not in f or "-00001-of-" in f]) == 1:
        chosen = next(f for f in ggufs if "-of-" not in f or "-00001-of-" in f)
    else:
        raise ImportError_(f"{repo_id} holds several .gguf files; pick one with --file: {', '.join(ggufs)}")
    if "-of-" in chosen:  # a split GGUF: every part of it
        stem = chosen.rsplit("-", 3)[0]
        return sorted(f for f in ggufs if fnmatch.fnmatch(f, f"{stem}-*-of-*.gguf"))
    return [chosen]


def _link_snapshot(snapshot: Path, files: list[Path], dest: Path) -> None:
    for f in files:
        rel = f.relative_to(snapshot)
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).symlink_to(f.resolve())


def _pull_mlx(spec: RepoSpec, sha: str, files: list[str], name: str, models_dir: Path, started: float):
    from .folder_import import describe

    wanted = [f for f in files if any(fnmatch.fnmatch(f, p) for p in MLX_PATTERNS)]
    paths = [_download(spec, sha, f) for f in wanted]
    snapshot = paths[0].parents[len(Path(wanted[0]).parts) - 1]
    arch, kind = describe(snapshot)

    def fill(tmp: Path) -> dict:
        _link_snapshot(snapshot, paths, tmp)
        return {
            "source": str(snapshot),
            "source_spec": f"hf:{spec.repo_id}@{sha}",
            "sha256": sha,
            "size_bytes": sum(p.stat().st_size for p in paths),
            "architecture": arch,
            "kind": kind,
            "reference": True,  # files live in the hub cache; this folder holds symlinks
            "options": {},
            "dtype": "?",
        }

    record = model_store.publish(models_dir, name, fill)
    dest = models_dir / name
    return ImportResult(name, dest, False, time.perf_counter() - started, record["size_bytes"], "?", arch)


def pull(
    spec_text: str,
    name: str | None = None,
    *,
    file: str | None = None,
    dtype: str | None = None,
    force: bool = False,
    models_dir: Path | None = None,
) -> ImportResult:
    spec = RepoSpec.parse(spec_text)
    name = name or spec.repo_id.split("/")[1]
    model_store.validate_model_name(name)
    models_dir = models_dir or model_store.models_dir()
    started = time.perf_counter()
    sha, files = _repo_files(spec)
    existing = model_store.read_import_record(models_dir / name)
    if not force and not file and existing and existing.get("sha256") == sha:
        size = existing.get("size_bytes", 0)
        return ImportResult(name, models_dir / name, True, 0.0, size, "?", existing.get("architecture", "?"))
    is_mlx = "config.json" in files and any(f.endswith(".safetensors") for f in files)
    if is_mlx and not file:
        return _pull_mlx(spec, sha, files, name, models_dir, started)
    if file or any(f.endswith(".gguf") for f in files):
        chosen = _pick_gguf(files, file, spec.repo_id)
        parts = [_download(spec, sha, f) for f in chosen]
        label = f"hf:{spec.repo_id}@{sha}/{chosen[0]}"
        return import_gguf(str(parts[0]), name, dtype=dtype, force=force, models_dir=models_dir, label=label)
    raise ImportError_(f"{spec.repo_id} is neither an MLX model (config.json + .safetensors) nor a GGUF repository")
