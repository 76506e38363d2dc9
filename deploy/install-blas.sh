#!/usr/bin/env bash
# Linux only: MLX's CPU wheel bundles a slow reference BLAS; Debian's OpenBLAS is ~30x
# faster for float32 matmul. The gateway preloads it into workers when it is present
# (shared/platform.py). Best effort: skipped without root or apt-get, never fatal.
set -u
[ "$(uname -s)" = "Linux" ] || exit 0
for lib in /usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3 \
           /usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3; do
  [ -e "$lib" ] && exit 0
done
if [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null; then
  echo "note: install libopenblas0-pthread for ~2.5x faster CPU inference (sudo apt-get install libopenblas0-pthread)"
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1 || {
  apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1
} || echo "note: could not install libopenblas0-pthread; CPU inference will be slower"
exit 0
