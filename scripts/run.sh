#!/usr/bin/env bash
# scripts/run.sh: builds chatgate and starts it on its embedded defaults: in-memory store,
# the built-in demo upstream, the shipped rules, the demo page at http://127.0.0.1:8080/.
# Extra arguments go to chatgate (try --help).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh build
cmake -S . -B build -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
cmake --build build --target chatgate -j "$(nproc)"
exec build/chatgate "$@"
