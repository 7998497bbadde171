#!/usr/bin/env bash
# Debian's headless Chromium for the dashboard's browser test (tests/browser).
# Installs it with apt when it is missing and we may (root, or passwordless sudo); otherwise
# says so and leaves it: the browser test then skips, naming this script.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "ensure-chromium: no apt-get here; install Chromium yourself for the browser test" >&2
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
    echo "ensure-chromium: not root and no passwordless sudo; run 'sudo apt-get install -y chromium' for the browser test" >&2
    exit 0
  fi
fi
echo "ensure-chromium: installing Debian's chromium (apt-get) for the browser test ..."
$SUDO apt-get update -q >/dev/null
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends chromium >/dev/null
command -v chromium
