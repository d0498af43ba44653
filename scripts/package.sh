#!/usr/bin/env bash
# scripts/package.sh: builds the Debian package (docs/operations.md, "Install from the package").
#   scripts/package.sh [BUILD_DIR]   -> BUILD_DIR/chatgate_VERSION_ARCH.deb (BUILD_DIR: build-pkg)
# A release build with CMake's CPack DEB generator: Depends from the binary's shared
# libraries (dpkg-shlibdeps, from dpkg-dev), the unit, the conffiles under /etc/chatgate,
# the man page, the bash completion, the dashboards. Installs what the build needs first.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-build-pkg}
scripts/deps.sh package
cmake -S . -B "$dir" -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build "$dir" --target chatgate -j "$(nproc)"
(cd "$dir" && cpack -G DEB >/dev/null)
deb=$(ls -t "$dir"/chatgate_*.deb | head -1)
echo "$deb"
