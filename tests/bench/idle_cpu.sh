#!/usr/bin/env bash
# What idle WebSocket connections cost the gateway's CPU: their pings and pongs. A gateway
# for many users holds far more quiet connections than busy ones, so what one costs must not
# grow with how many there are (issue 39: lws's own keepalive walked every connection's
# timer at each ping and pong, so the whole cost grew with the square of the count).
#
#   tests/bench/idle_cpu.sh BUILD_DIR [CONNECTIONS="1000 4000 8000"] [PING_S=2] [SECONDS=10] [BINARY...]
#
# For each binary (default BUILD_DIR/chatgate) and each count: the gateway (demo upstream,
# no rules, memory store, ping_interval_s PING_S, idle_timeout_s 20 * PING_S) on a free
# port; cg_bench opens that many connections and holds them idle (they answer the pings);
# from 2 * PING_S after the last one is up, the gateway's CPU (user + system, /proc/PID/stat)
# over SECONDS is divided by the pings the connections got in that time (CONNECTIONS *
# SECONDS / PING_S). Prints one line a run:
#   IDLE binary=... connections=N cpu_ms_per_s=X us_per_ping=Y
# Needs a descriptor limit over the largest count (ulimit -n).
set -u
. "$(dirname "$0")/ports.sh"

if [ $# -lt 1 ]; then
	echo "usage: $0 BUILD_DIR [CONNECTIONS] [PING_S] [SECONDS] [BINARY...]" >&2
	exit 2
fi
build=$(cd "$1" && pwd)
counts=${2:-1000 4000 8000} ping_s=${3:-2} secs=${4:-10}
shift $(($# < 4 ? $# : 4))
binaries=("$@")
[ ${#binaries[@]} = 0 ] && binaries=("$build/chatgate")
bench_workdir idle_cpu
mkdir -p "$tmp/norules"
hz=$(getconf CLK_TCK)

cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

for bin in "${binaries[@]}"; do
	for n in $counts; do
		port=$(pick_free_port) || exit 1
		cat >"$tmp/chatgate.json" <<EOF
{"upstreams":{"demo":{"url":"demo","delay_ms":0}},"default_upstream":"demo","max_connections":$((n + 100)),
 "ping_interval_s":$ping_s,"idle_timeout_s":$((ping_s * 20))}
EOF
		bench_start gateway "$port" "$bin" --listen "127.0.0.1:$port" --config "$tmp/chatgate.json" \
			--rules "$tmp/norules" --store memory || exit 1
		gw=$started_pid
		hold=$((secs + 4 * ping_s + 30))
		"$build/tests/bench/cg_bench" --url "ws://127.0.0.1:$port/ws" --connections "$n" --idle "$hold" \
			--pid "$gw" >"$tmp/cg_bench.out" 2>&1 &
		client=$!
		# up: the gateway counts its connections in /metrics
		for _ in $(seq 300); do
			up=$(curl -s "http://127.0.0.1:$port/metrics" | awk '/^chatgate_connections /{print $2}')
			[ "${up:-0}" -ge "$n" ] && break
			sleep 0.1
		done
		sleep $((2 * ping_s))
		a=$(cpu_ticks "$gw")
		sleep "$secs"
		b=$(cpu_ticks "$gw")
		kill "$client" "$gw" 2>/dev/null
		wait "$client" "$gw" 2>/dev/null
		awk -v bin="$bin" -v n="$n" -v up="${up:-0}" -v t=$((b - a)) -v hz="$hz" -v s="$secs" -v p="$ping_s" 'BEGIN {
			ms = t * 1000 / hz
			printf "IDLE binary=%s connections=%d up=%d cpu_ms_per_s=%.1f us_per_ping=%.1f\n", bin, n, up, ms / s,
				ms * 1000 / (n * s / p) }'
	done
done
