#!/usr/bin/env bash
# scripts/deps.sh: installs the Debian 12 packages chatgate needs, when any is missing.
# Usage: scripts/deps.sh [build|test]   (test adds what the test suite runs on)
set -euo pipefail

packages=(gcc make cmake pkg-config libwebsockets-dev libuv1-dev libjansson-dev
          libhiredis-dev libpcre2-dev libssl-dev)
if [ "${1:-build}" = test ]; then
  packages+=(python3 python3-websockets)
fi

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "chatgate: installing ${missing[*]}" >&2
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
