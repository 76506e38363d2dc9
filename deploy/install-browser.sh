#!/usr/bin/env bash
# The console's browser tests (tests/e2e/test_console.py) drive Debian's chromium through its
# chromium-driver: nothing is downloaded at test time. Idempotent; best effort: as root, or
# with passwordless sudo (CI runners), it installs them with apt-get; otherwise it prints how
# to, and those tests skip saying why.
set -u
if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ] && command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
  SUDO="sudo -n"
fi
if [ "$(uname -s)" != "Linux" ] || { [ "$(id -u)" != "0" ] && [ -z "$SUDO" ]; } || ! command -v apt-get >/dev/null; then
  echo "note: the console's browser tests need chromium and chromium-driver (Debian: sudo apt-get install chromium chromium-driver); they skip without them"
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || {
  $SUDO apt-get update -q >/dev/null 2>&1 && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null 2>&1
} || echo "note: could not install chromium and chromium-driver; the console's browser tests will skip"
exit 0
