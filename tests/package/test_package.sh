#!/bin/sh
# tests/package/test_package.sh BUILD_DIR SOURCE_DIR: the Debian package, end to end.
#   1. cpack builds it from BUILD_DIR; its control data: Depends from the shared libraries
#      (libwebsockets, jansson, hiredis, PCRE2, libuv, OpenSSL, curl) and adduser, the
#      conffiles, the files where Debian wants them;
#   2. dpkg -i installs it (apt-get -f install when a dependency is missing); the chatgate
#      system user exists, the secrets file is root:chatgate 0640;
#   3. the installed binary starts as that user on the example config and serves /healthz,
#      the page and the rules from /usr/share/chatgate; SIGHUP reloads; SIGTERM stops it (0);
#   4. a second dpkg -i (the path of an upgrade) after the operator deleted the secrets
#      file: the postinst copes, dpkg keeps it deleted;
#   5. the unit passes `systemd-analyze verify`, and `systemd-analyze security` rates it
#      (its exposure is printed, and must stay under 3.0: "OK");
#   6. dpkg --purge removes it and /etc/chatgate, leaving nothing of it behind.
set -u
build=$1
src=$2
say() { echo "-- $*"; }
fail() { echo "FAIL: $*" >&2; exit 1; }
skip() { echo "SKIP: $*" >&2; exit 77; }

[ "$(id -u)" -eq 0 ] || skip "not root: dpkg -i installs system-wide"
command -v dpkg >/dev/null && command -v cpack >/dev/null || skip "dpkg or cpack missing"
command -v dpkg-shlibdeps >/dev/null || fail "dpkg-shlibdeps missing: scripts/deps.sh test installs dpkg-dev"
if dpkg-query -W -f='${Status}' chatgate 2>/dev/null | grep -q "ok installed"; then
    skip "a chatgate package is installed already: not replacing it"
fi
[ -e /usr/bin/chatgate ] && skip "/usr/bin/chatgate exists, not from a package"

work=$(mktemp -d)
pid=
installed=0
cleanup() {
    [ -n "$pid" ] && kill -9 "$pid" 2>/dev/null
    [ "$installed" = 1 ] && dpkg --purge chatgate >/dev/null 2>&1
    rm -rf "$work"
}
trap cleanup EXIT

say "cpack -G DEB"
(cd "$build" && cpack -G DEB -B "$work" >"$work/cpack.log" 2>&1) || { cat "$work/cpack.log"; fail "cpack failed"; }
deb=$(ls "$work"/chatgate_*.deb 2>/dev/null | head -1)
[ -n "$deb" ] || fail "no .deb in $work"
echo "   $(basename "$deb"), $(stat -c %s "$deb") bytes"

say "its control data: Depends, conffiles, maintainer scripts"
depends=$(dpkg-deb -f "$deb" Depends)
echo "   Depends: $depends"
for lib in libwebsockets libjansson libhiredis libpcre2-8 libuv1 libssl libcurl libyajl libmimalloc adduser; do
    echo "$depends" | grep -q "$lib" || fail "Depends lacks $lib"
done
dpkg-deb -e "$deb" "$work/control"
for f in /etc/chatgate/chatgate.json /etc/chatgate/chatgate.env; do
    grep -qx "$f" "$work/control/conffiles" || fail "$f is not a conffile: $(cat "$work/control/conffiles")"
done
for s in postinst prerm postrm; do [ -x "$work/control/$s" ] || fail "no $s"; done
dpkg-deb -c "$deb" | awk '{print $6}' | sed 's|^\./|/|' >"$work/files"
for f in /usr/bin/chatgate /usr/share/chatgate/rules/10-cancel.rules /usr/share/chatgate/web/index.html \
         /lib/systemd/system/chatgate.service /usr/share/doc/chatgate/copyright /usr/share/doc/chatgate/README.md \
         /usr/share/man/man1/chatgate.1 /usr/share/bash-completion/completions/chatgate \
         /usr/share/chatgate/monitoring/grafana/chatgate.json /usr/share/chatgate/monitoring/prometheus/chatgate-alerts.yml; do
    grep -qx "$f" "$work/files" || fail "the package lacks $f"
done

say "dpkg -i"
export DEBIAN_FRONTEND=noninteractive
installed=1
if ! dpkg -i "$deb" >"$work/dpkg.log" 2>&1; then
    apt-get -f install -y -qq >>"$work/dpkg.log" 2>&1 || { cat "$work/dpkg.log"; fail "dpkg -i and apt-get -f install failed"; }
fi
dpkg-query -W -f='${Status}' chatgate | grep -q "ok installed" || { cat "$work/dpkg.log"; fail "not installed"; }
id chatgate >/dev/null 2>&1 || fail "no chatgate user"
[ "$(stat -c '%U:%G %a' /etc/chatgate/chatgate.env)" = "root:chatgate 640" ] ||
    fail "/etc/chatgate/chatgate.env is $(stat -c '%U:%G %a' /etc/chatgate/chatgate.env), want root:chatgate 640"
man -w chatgate >/dev/null 2>&1 || command -v man >/dev/null || true

say "the installed binary, as the chatgate user, on the example config"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
# setpriv execs (runuser would fork): the pid is chatgate's own, for the signals below
setpriv --reuid=chatgate --regid=chatgate --init-groups /usr/bin/chatgate --config /etc/chatgate/chatgate.json \
    --listen "127.0.0.1:$port" >"$work/gateway.log" 2>&1 &
pid=$!
up=0
for _ in $(seq 1 50); do
    if curl -fsS "http://127.0.0.1:$port/healthz" >"$work/healthz" 2>/dev/null; then up=1; break; fi
    sleep 0.1
done
[ "$up" = 1 ] || { cat "$work/gateway.log"; fail "no /healthz on port $port"; }
grep -q '"status":"ok"' "$work/healthz" || fail "/healthz said $(cat "$work/healthz")"
curl -fsS -o "$work/page" "http://127.0.0.1:$port/" && grep -qi "<html" "$work/page" ||
    fail "the page is not served from /usr/share/chatgate/web"
grep -q "rules: .* from /usr/share/chatgate/rules" "$work/gateway.log" || { cat "$work/gateway.log"; fail "rules not from /usr/share"; }
kill -HUP "$pid"
sleep 0.3
grep -q "rules: reloaded" "$work/gateway.log" || { cat "$work/gateway.log"; fail "SIGHUP did not reload the rules"; }
kill -TERM "$pid"
wait "$pid"
rc=$?
pid=
[ "$rc" = 0 ] || { cat "$work/gateway.log"; fail "exit $rc after SIGTERM"; }

say "dpkg -i again (an upgrade's path) with the secrets file deleted by the operator"
rm /etc/chatgate/chatgate.env
dpkg -i "$deb" >"$work/dpkg2.log" 2>&1 || { cat "$work/dpkg2.log"; fail "reinstalling over a deleted chatgate.env failed"; }
[ -e /etc/chatgate/chatgate.env ] && fail "dpkg brought back a conffile the operator deleted"
grep -q '"listen"' /etc/chatgate/chatgate.json || fail "the configuration went missing on reinstall"

if command -v systemd-analyze >/dev/null; then
    say "the unit: systemd-analyze verify and security"
    systemd-analyze verify /lib/systemd/system/chatgate.service >"$work/verify.log" 2>&1 ||
        { cat "$work/verify.log"; fail "systemd-analyze verify"; }
    systemd-analyze security --offline=yes /lib/systemd/system/chatgate.service >"$work/security.log" 2>&1
    score=$(sed -n 's/.*Overall exposure level for chatgate.service: \([0-9.]*\).*/\1/p' "$work/security.log")
    [ -n "$score" ] || { cat "$work/security.log"; fail "no exposure level from systemd-analyze security"; }
    echo "   systemd-analyze security: exposure $score"
    awk -v s="$score" 'BEGIN { exit !(s < 3.0) }' || { cat "$work/security.log"; fail "exposure $score is not under 3.0"; }
else
    say "systemd-analyze missing: the unit is not checked (scripts/deps.sh test installs systemd)"
fi

say "dpkg --purge"
dpkg --purge chatgate >"$work/purge.log" 2>&1 || { cat "$work/purge.log"; fail "dpkg --purge"; }
installed=0
for f in /usr/bin/chatgate /usr/share/chatgate /etc/chatgate /lib/systemd/system/chatgate.service /usr/share/doc/chatgate; do
    [ -e "$f" ] && fail "$f is still there after the purge"
done
echo "PASS"
