#!/usr/bin/env bash
# Renders a report.html in a real browser (Debian's headless chromium) and saves a PNG, to
# look at what `cdcca-sim` wrote the way a reader's browser shows it.
#   scripts/report_screenshot.sh runs/quickstart/report.html docs/images/report_screenshot.png
# Installs the `chromium` package (as root, apt-get) if no chromium is on PATH. Not part of
# scripts/test.sh: the tests check the HTML itself (sim/report_test.cc).
set -euo pipefail
if [ $# -ne 2 ]; then
  echo "usage: $0 REPORT_HTML OUT_PNG" >&2
  exit 2
fi
html="$(realpath "$1")"
out="$(realpath -m "$2")"
[ -f "$html" ] || { echo "$0: no such file: $1" >&2; exit 1; }
browser="$(command -v chromium || command -v chromium-browser || true)"
if [ -z "$browser" ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "$0: chromium is not installed; run as root or: apt-get install -y chromium" >&2
    exit 1
  fi
  echo "== installing chromium (apt-get)" >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium >&2
  browser="$(command -v chromium)"
fi
profile="$(mktemp -d)"
trap 'rm -rf "$profile"' EXIT
mkdir -p "$(dirname "$out")"
# No network, no first-run or background services: the page is one offline file.
"$browser" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
  --disable-background-networking --disable-component-update --disable-sync \
  --user-data-dir="$profile" --hide-scrollbars --screenshot="$out" --window-size=1280,2400 \
  "file://$html" >&2
[ -s "$out" ] || { echo "$0: chromium wrote no screenshot" >&2; exit 1; }
echo "$out"
