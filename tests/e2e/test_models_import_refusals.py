"""Import hygiene: hostile GGUF headers and model folders end in a clean
error (exit code 2 and a message), never a crash, a traceback or a huge allocation; a
folder import reads only regular files inside the folder."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
from helpers.gguf_bytes import ARRAY, STRING, U32, RawGGUF, RawTensor, f32_tensor, gguf_string, tiny_llama_metadata
from helpers.mlxgw_cli import assert_clean_error, mlxgw


def _import(source: Path, home: Path, name: str = "hostile"):
    result = mlxgw("models", "import", str(source), "--name", name, home=home, timeout=120)
    return result


def _assert_nothing_imported(home: Path, name: str = "hostile") -> None:
    assert not (home / "models" / name).exists()


def test_key_length_of_2_62_is_a_clean_error(tmp_path):
    raw = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + gguf_string("general.name", claimed_length=1 << 62) + b"\0" * 64
    (tmp_path / "bad.gguf").write_bytes(raw)
    assert_clean_error(_import(tmp_path / "bad.gguf", tmp_path), "at most 65535")
    _assert_nothing_imported(tmp_path)


def test_string_value_longer_than_the_file_is_a_clean_error(tmp_path):
    raw = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + gguf_string("k") + struct.pack("<I", STRING)
    raw += gguf_string("x", claimed_length=(1 << 63) - 1)
    (tmp_path / "bad.gguf").write_bytes(raw)
    assert_clean_error(_import(tmp_path / "bad.gguf", tmp_path), "but the file has")


def test_array_longer_than_the_file_is_a_clean_error(tmp_path):
    raw = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + gguf_string("tokenizer.ggml.tokens")
    raw += struct.pack("<IIQ", ARRAY, STRING, 1 << 60) + b"\0" * 64
    (tmp_path / "bad.gguf").write_bytes(raw)
    assert_clean_error(_import(tmp_path / "bad.gguf", tmp_path), "array elements")


def test_array_beyond_the_element_cap_is_refused_even_when_the_file_is_large_enough(tmp_path):
    count = (1 << 22) + 1
    raw = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + gguf_string("general.tags")
    raw += struct.pack("<IIQ", ARRAY, 0, count) + b"\0" * count  # 0: uint8 elements
    (tmp_path / "bad.gguf").write_bytes(raw)
    assert_clean_error(_import(tmp_path / "bad.gguf", tmp_path), "at most 4194304")


def test_tensor_with_100_dimensions_is_a_clean_error(tmp_path):
    gguf = RawGGUF(tiny_llama_metadata(), [RawTensor("token_embd.weight", [1] * 100, 0, b"\0" * 4)])
    assert_clean_error(_import(gguf.write(tmp_path / "bad.gguf"), tmp_path), "100 dimensions")


def test_block_count_of_a_billion_is_a_clean_error(tmp_path):
    gguf = RawGGUF(tiny_llama_metadata(block_count=1_000_000_000), [f32_tensor("token_embd.weight", [8, 4])])
    assert_clean_error(_import(gguf.write(tmp_path / "bad.gguf"), tmp_path), "llama.block_count")


def test_block_count_that_disagrees_with_the_tensors_is_a_clean_error(tmp_path):
    gguf = RawGGUF(tiny_llama_metadata(block_count=3), [f32_tensor("token_embd.weight", [8, 4])])
    assert_clean_error(_import(gguf.write(tmp_path / "bad.gguf"), tmp_path), "block_count is 3")


def test_unknown_tensor_type_is_a_clean_error(tmp_path):
    gguf = RawGGUF(tiny_llama_metadata(), [RawTensor("token_embd.weight", [8, 4], 99, b"\0" * 128)])
    assert_clean_error(_import(gguf.write(tmp_path / "bad.gguf"), tmp_path), "unknown tensor type 99")


def test_known_but_unsupported_tensor_type_is_named(tmp_path):
    # TQ1_0 (type 34): a real llama.cpp type that MLX's reader silently drops.
    gguf = RawGGUF(tiny_llama_metadata(), [RawTensor("token_embd.weight", [256, 1], 34, b"\0" * 54)])
    assert_clean_error(_import(gguf.write(tmp_path / "bad.gguf"), tmp_path), "TQ1_0")


def test_tensor_past_the_end_of_the_file_is_a_clean_error(tmp_path):
    gguf = RawGGUF(tiny_llama_metadata(), [RawTensor("token_embd.weight", [8, 4], 0, b"\0" * 128, offset=1 << 40)])
    assert_clean_error(_import(gguf.write(tmp_path / "bad.gguf"), tmp_path), "runs past the end of the file")


def test_huge_dimensions_are_a_clean_error(tmp_path):
    gguf = RawGGUF(tiny_llama_metadata(), [RawTensor("token_embd.weight", [1 << 62, 1 << 62], 0, b"\0" * 32)])
    assert_clean_error(_import(gguf.write(tmp_path / "bad.gguf"), tmp_path), "runs past the end of the file")


def test_token_id_outside_the_vocabulary_is_a_clean_error(tmp_path):
    metadata = tiny_llama_metadata(block_count=1) + [("tokenizer.ggml.bos_token_id", U32, 4_000_000)]
    tensors = [f32_tensor("token_embd.weight", [8, 4])] + [
        f32_tensor(f"blk.0.{n}.weight", [8]) for n in ("attn_norm", "ffn_norm")
    ]
    gguf = RawGGUF(metadata, tensors)
    assert_clean_error(_import(gguf.write(tmp_path / "bad.gguf"), tmp_path), "bos_token_id")


def _model_folder(folder: Path) -> Path:
    import mlx.core as mx

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    mx.save_safetensors(str(folder / "model.safetensors"), {"w": mx.zeros((2, 2))})
    return folder


@pytest.mark.skipif(not Path("/etc/passwd").exists(), reason="needs a system file to point at")
def test_symlink_to_a_system_file_is_refused(tmp_path):
    folder = _model_folder(tmp_path / "src")
    (folder / "passwd").symlink_to("/etc/passwd")
    assert_clean_error(_import(folder, tmp_path), "passwd", "outside the model folder")
    _assert_nothing_imported(tmp_path)
    assert not list((tmp_path / "models").rglob("passwd")) if (tmp_path / "models").exists() else True


def test_config_json_symlinked_outside_is_refused(tmp_path):
    folder = _model_folder(tmp_path / "src")
    (tmp_path / "elsewhere.json").write_text("{}")
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to(tmp_path / "elsewhere.json")
    assert_clean_error(_import(folder, tmp_path), "config.json", "outside the model folder")


def test_parent_directory_symlink_loop_is_a_clean_error(tmp_path):
    folder = _model_folder(tmp_path / "src")
    (folder / "loop").symlink_to("..")
    assert_clean_error(_import(folder, tmp_path), "loop", "directory symlinks are not followed")
    _assert_nothing_imported(tmp_path)


def test_self_referencing_symlink_is_a_clean_error(tmp_path):
    folder = _model_folder(tmp_path / "src")
    os.symlink("self.json", folder / "self.json")
    assert_clean_error(_import(folder, tmp_path), "self.json", "looping symlink")


def test_fifo_in_the_folder_is_refused_without_blocking(tmp_path):
    folder = _model_folder(tmp_path / "src")
    os.mkfifo(folder / "pipe")
    assert_clean_error(_import(folder, tmp_path), "pipe", "not a regular file")


def test_symlink_inside_the_folder_is_copied_as_a_regular_file(tmp_path):
    folder = _model_folder(tmp_path / "src")
    (folder / "extra").mkdir()
    (folder / "extra" / "notes.txt").write_text("inside")
    (folder / "notes-link.txt").symlink_to("extra/notes.txt")
    result = _import(folder, tmp_path, name="ok")
    assert result.returncode == 0, result.stderr
    copied = tmp_path / "models" / "ok" / "notes-link.txt"
    assert not copied.is_symlink() and copied.read_text() == "inside"


def test_hub_cache_snapshot_with_blob_symlinks_imports(tmp_path):
    repo = tmp_path / "hub" / "models--org--tiny"
    blobs = _model_folder(repo / "blobs-src")
    (repo / "blobs").mkdir()
    snapshot = repo / "snapshots" / "0123abc"
    snapshot.mkdir(parents=True)
    for i, name in enumerate(("config.json", "model.safetensors")):
        (blobs / name).rename(repo / "blobs" / f"blob{i}")
        (snapshot / name).symlink_to(Path("../../blobs") / f"blob{i}")
    result = _import(snapshot, tmp_path, name="from-cache")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "models" / "from-cache" / "model.safetensors").is_file()
