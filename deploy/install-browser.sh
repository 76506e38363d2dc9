#!/usr/bin/env bash
# The console's browser tests (tests/test_console.py) drive Debian's chromium through its
# chromium-driver: nothing is downloaded at test time. Idempotent; best effort: without
# root or apt-get it prints how to install them, and those tests skip saying why.
set -u
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
  exit 0
fi
if [ "$(uname -s)" != "Linux" ] || [ "$(id -u)" != "0" ] || ! command -v apt-get >/dev/null; then
  echo "note: the console's browser tests need chromium and chromium-driver (Debian: sudo apt-get install chromium chromium-driver); they skip without them"
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || {
  apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium chromium-driver >/dev/null 2>&1
} || echo "note: could not install chromium and chromium-driver; the console's browser tests will skip"
exit 0
