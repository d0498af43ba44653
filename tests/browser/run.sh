#!/bin/sh
# ctest's entry for the browser tests (tests/browser/CMakeLists.txt):
#   sh tests/browser/run.sh [SCRIPT.test.js] CHATGATE_BINARY [options]
# Runs SCRIPT (demo.test.js by default) with playwright-core (and ws, for origin_app.js)
# from tests/browser/node_modules when someone ran
# `npm ci` there, else from ./node_modules of the current (build) directory, installing it
# there with `npm ci` from package-lock.json when missing or out of date. Only the npm
# package is installed: the browser is Debian's /usr/bin/chromium, never a download.
# Exits 77 (ctest: skipped) when node, npm or chromium is missing, unless
# CHATGATE_REQUIRE_BROWSER=1 (then 1).
set -u
script=demo.test.js
case "${1:-}" in *.test.js) script=$1; shift ;; esac
here=$(cd "$(dirname "$0")" && pwd)
work=$(pwd)

missing() {
    echo "SKIP: $1" >&2
    if [ "${CHATGATE_REQUIRE_BROWSER:-0}" = 1 ]; then exit 1; fi
    exit 77
}

command -v node >/dev/null 2>&1 || missing "node not found (Debian: apt-get install nodejs npm)"
chromium=${CHATGATE_CHROMIUM:-/usr/bin/chromium}
[ -x "$chromium" ] || missing "$chromium not found (Debian: apt-get install chromium)"

if [ -f "$here/node_modules/playwright-core/package.json" ] && [ -f "$here/node_modules/ws/package.json" ]; then
    modules=$here/node_modules
else
    modules=$work/node_modules
    if [ ! -f "$modules/playwright-core/package.json" ] || [ ! -f "$modules/ws/package.json" ] ||
        ! cmp -s "$here/package-lock.json" "$work/package-lock.json"; then
        command -v npm >/dev/null 2>&1 || missing "npm not found (Debian: apt-get install npm)"
        echo "installing playwright-core into $work (npm ci)"
        cp "$here/package.json" "$here/package-lock.json" "$work/" || exit 1
        if ! (cd "$work" && PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 npm ci --no-audit --no-fund --ignore-scripts); then
            rm -f "$work/package-lock.json" # so the next run tries again
            echo "FAIL: npm ci in $work did not install playwright-core (is the npm registry reachable?)" >&2
            exit 1
        fi
    fi
fi

NODE_PATH=$modules
export NODE_PATH
exec node "$here/$script" "$@"
