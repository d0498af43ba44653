#!/usr/bin/env bash
# scripts/test.sh: installs what is missing, builds, and runs the whole test suite (ctest).
#   scripts/test.sh              normal build in build/
#   scripts/test.sh --sanitize   AddressSanitizer + UBSan build in build-asan/
#   scripts/test.sh --fuzz       the libFuzzer targets (clang) in build-fuzz/, 30 s each
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh test

if [ "${1:-}" = --fuzz ]; then
  scripts/deps.sh fuzz
  cmake -S . -B build-fuzz -DCMAKE_C_COMPILER=clang -DCHATGATE_FUZZ=ON -DCMAKE_BUILD_TYPE=Debug >/dev/null
  cmake --build build-fuzz --target fuzz_all -j "$(nproc)"
  cd build-fuzz
  exec ctest --output-on-failure -L fuzz
fi

dir=build
flags=(-DCMAKE_BUILD_TYPE=RelWithDebInfo)
if [ "${1:-}" = --sanitize ]; then
  dir=build-asan
  flags=(-DCMAKE_BUILD_TYPE=Debug -DCHATGATE_SANITIZE=ON)
  export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
  export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
fi
cmake -S . -B "$dir" "${flags[@]}" >/dev/null
cmake --build "$dir" -j "$(nproc)"
cd "$dir"
ctest --output-on-failure -j 2
