#!/usr/bin/env bash
# scripts/deps.sh: installs the Debian 12 packages chatgate needs, when any is missing.
# Usage: scripts/deps.sh [build|test|fuzz|bench|package]   (test adds what the test suite runs on,
#        fuzz also clang and its libFuzzer runtime, bench what tests/bench/compare.sh
#        compares with: nginx, Redis, node)
set -euo pipefail

packages=(gcc make cmake pkg-config tzdata libwebsockets-dev libuv1-dev libjansson-dev
          libhiredis-dev libpcre2-dev libssl-dev libcurl4-openssl-dev libyajl-dev libmimalloc-dev)
case "${1:-build}" in
  test)
    # nginx: the Socket.IO test runs examples/nginx-socketio.conf in an nginx of its own
    packages+=(python3 python3-websockets python3-tornado redis-server redis-sentinel nutcracker haproxy chromium nginx)
    # the package test builds the .deb (dpkg-shlibdeps) and checks its unit (systemd-analyze);
    # the dashboard test validates the alert rules with promtool (Debian's prometheus)
    packages+=(dpkg-dev systemd prometheus python3-yaml curl)
    # openssl: the upstream tests make a self-signed certificate
    packages+=(openssl)
    # the browser test runs on node; an image may bring its own node (not Debian's package)
    command -v node >/dev/null && command -v npm >/dev/null || packages+=(nodejs npm)
    ;;
  fuzz) packages+=(clang libclang-rt-14-dev) ;;
  # scripts/package.sh: dpkg-shlibdeps for the package's Depends
  package) packages+=(dpkg-dev fakeroot) ;;
  bench)
    # tests/bench/compare.sh and instructions.sh (valgrind); not in test: CI runs no
    # benchmarks. The Debian nginx package starts a service on port 80 where there is an
    # init system: compare.sh runs its own.
    packages+=(nginx redis-server valgrind curl)
    command -v node >/dev/null && command -v npm >/dev/null || packages+=(nodejs npm)
    ;;
esac

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "chatgate: installing ${missing[*]}" >&2
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
$sudo apt-get update -qq
# Debian's nginx (and haproxy, redis-server) start a system service when installed; nginx's
# fails where port 80 is taken, which fails the install. The tests run their own servers,
# so while installing, services are not started (policy-rc.d, as Debian's container images
# do), unless the machine already says otherwise.
policy=/usr/sbin/policy-rc.d
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
  $sudo chmod +x "$policy"
  trap '$sudo rm -f "$policy"' EXIT
fi
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
