#!/usr/bin/env bash
# The browser of the console's tests (tests/console): Debian's Chromium, which Playwright drives by its path.
# Installed when missing (CI runs as root); Playwright's own browser download is never used.
set -euo pipefail
[ -x /usr/bin/chromium ] && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "scripts/chromium.sh: /usr/bin/chromium is missing; install it as root: apt-get install chromium" >&2
  exit 1
fi
apt-get update -q
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium
