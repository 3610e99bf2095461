#!/usr/bin/env bash
# Headless Chromium for the browser tests (make test-ui, tests/ui/test_browser.py) and the UI
# screenshots (infra/screenshot_compare.py): Debian's `chromium` package. Does nothing when a
# chromium is already on PATH; installing needs root (apt-get).
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
  chromium --version
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "chromium is not installed and this is not root: run 'sudo apt-get install -y chromium'" >&2
  exit 1
fi
apt-get update -q
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium
chromium --version
