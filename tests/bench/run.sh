#!/usr/bin/env bash
# Benchmark a built chatgate: start it on a free local port with the demo
# upstream (no delay) and its limits opened up, drive it with cg_bench in a
# closed loop, stop it with SIGTERM, and print the result.
#
#   tests/bench/run.sh BUILD_DIR [CONNECTIONS] [SECONDS]
#
# CONNECTIONS defaults to 10, SECONDS (the measured window, after a 1 s
# warmup) to 10. Environment:
#   CG_BENCH_ARGS   extra cg_bench options, e.g. "--warmup 2 --progress"
#   CHATGATE_BIN    gateway binary (default BUILD_DIR/chatgate)
#   CG_BENCH_KEEP=1 keep the temporary directory (config, gateway log)
#   CG_BENCH_STORE=redis  run against a redis-server started here on a free
#                   port (default: the in-memory store); prints Redis
#                   commands and round trips per message (INFO commandstats)
#   CG_BENCH_STORE=cluster:N  run against a Redis Cluster of N masters (no
#                   replicas) made here with redis-cli --cluster create, through
#                   redis-cluster:// (the gateway's own cluster client); prints
#                   the Redis CPU of the masters over the run
#
# Exit status: 0 on a complete run; cg_bench's status if it failed (1: no
# connection, no completed message, or every connection lost); 1 if the
# gateway did not start; 3 if the gateway did not exit 0 on SIGTERM within
# STOP_TIMEOUT seconds.
set -u

STOP_TIMEOUT=15

usage() {
	echo "usage: $0 BUILD_DIR [CONNECTIONS] [SECONDS]" >&2
	exit 2
}

if [ $# -lt 1 ] || [ $# -gt 3 ]; then
	usage
fi
build_dir=$1
conns=${2:-10}
secs=${3:-10}
case $conns in '' | *[!0-9]*) usage ;; esac
case $secs in '' | *[!0-9.]*) usage ;; esac

gateway=${CHATGATE_BIN:-$build_dir/chatgate}
bench=
for candidate in "$build_dir/tests/bench/cg_bench" "$build_dir/cg_bench"; do
	if [ -x "$candidate" ]; then
		bench=$candidate
		break
	fi
done
if [ ! -x "$gateway" ]; then
	echo "run.sh: no gateway binary at $gateway" >&2
	exit 1
fi
if [ -z "$bench" ]; then
	echo "run.sh: no cg_bench in $build_dir/tests/bench or $build_dir (build target cg_bench)" >&2
	exit 1
fi

tmp=$(mktemp -d "${TMPDIR:-/tmp}/cg_bench.XXXXXX") || exit 1
gateway_pid=
redis_pid=
cluster_pids=()

# shellcheck disable=SC2317  # called through the EXIT trap
cleanup() {
	if [ -n "$gateway_pid" ] && kill -0 "$gateway_pid" 2>/dev/null; then
		kill -KILL "$gateway_pid" 2>/dev/null
		wait "$gateway_pid" 2>/dev/null
	fi
	for pid in "${cluster_pids[@]}"; do
		kill -TERM "$pid" 2>/dev/null
		wait "$pid" 2>/dev/null
	done
	if [ -n "$redis_pid" ]; then
		kill -TERM "$redis_pid" 2>/dev/null
		wait "$redis_pid" 2>/dev/null
	fi
	if [ "${CG_BENCH_KEEP:-0}" = 1 ]; then
		echo "run.sh: kept $tmp" >&2
	else
		rm -rf "$tmp"
	fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Many connections need many descriptors, in the gateway and in cg_bench.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

max_connections=5000
if [ "$conns" -gt $((max_connections - 100)) ]; then
	max_connections=$((conns + 100))
fi
cat >"$tmp/config.json" <<EOF
{"upstreams":{"demo":{"url":"demo","delay_ms":0}},"rate_limit":{"messages_per_second":100000,"burst":100000},"max_connections":$max_connections}
EOF

# shellcheck source=tests/bench/ports.sh
. "$(dirname "$0")/ports.sh"

store=memory
case ${CG_BENCH_STORE:-memory} in
cluster:[1-9])
	n=${CG_BENCH_STORE#cluster:}
	seeds=
	for i in $(seq 1 "$n"); do
		cport=$(pick_free_port) || exit 1
		bport=$(pick_free_port) || exit 1
		mkdir -p "$tmp/node$i"
		redis-server --port "$cport" --cluster-port "$bport" --bind 127.0.0.1 --save "" --appendonly no \
			--cluster-enabled yes --cluster-config-file "$tmp/node$i/nodes.conf" --dir "$tmp/node$i" \
			>"$tmp/node$i/redis.log" 2>&1 &
		cluster_pids+=($!)
		for _ in $(seq 1 50); do
			redis-cli -p "$cport" ping >/dev/null 2>&1 && break
			sleep 0.1
		done
		seeds="$seeds${seeds:+ }127.0.0.1:$cport"
		[ "$i" = 1 ] && first_bus=$bport
	done
	# the slots in N even ranges, one a node, and every node told of the first (CLUSTER MEET):
	# redis-cli --cluster create wants 3 masters at least
	i=0
	first=${seeds%% *}
	for node in $seeds; do
		lo=$((16384 * i / n))
		hi=$((16384 * (i + 1) / n - 1))
		redis-cli -p "${node##*:}" cluster addslotsrange "$lo" "$hi" >/dev/null
		[ "$node" != "$first" ] && redis-cli -p "${node##*:}" cluster meet 127.0.0.1 "${first##*:}" "$first_bus" >/dev/null
		i=$((i + 1))
	done
	for node in $seeds; do
		for _ in $(seq 1 100); do
			redis-cli -p "${node##*:}" cluster info 2>/dev/null | grep -q 'cluster_state:ok' &&
				[ "$(redis-cli -p "${node##*:}" cluster slots | grep -c '^127.0.0.1$')" -ge "$n" ] && break
			sleep 0.1
		done
	done
	store="redis-cluster://${seeds// /,}"
	;;
esac
if [ "${CG_BENCH_STORE:-memory}" = redis ]; then
	redis_port=$(pick_free_port) || exit 1
	redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no --dir "$tmp" \
		>"$tmp/redis.log" 2>&1 &
	redis_pid=$!
	for _ in $(seq 1 50); do
		redis-cli -p "$redis_port" ping >/dev/null 2>&1 && break
		sleep 0.1
	done
	store="redis://127.0.0.1:$redis_port"
fi

# Start the gateway; a port taken between the check and the bind makes it exit
# at once, so try a few ports.
started=0
for attempt in 1 2 3; do
	port=$(pick_free_port) || break
	"$gateway" --listen "127.0.0.1:$port" --config "$tmp/config.json" --store "$store" >"$tmp/gateway.log" 2>&1 &
	gateway_pid=$!
	for _ in $(seq 1 100); do
		if ! kill -0 "$gateway_pid" 2>/dev/null; then
			break
		fi
		if port_is_open "$port"; then
			started=1
			break
		fi
		sleep 0.1
	done
	[ $started = 1 ] && break
	if kill -0 "$gateway_pid" 2>/dev/null; then
		echo "run.sh: gateway (pid $gateway_pid) did not listen on port $port within 10 s" >&2
		break
	fi
	wait "$gateway_pid" 2>/dev/null
	echo "run.sh: gateway exited at start (status $?, attempt $attempt):" >&2
	tail -n 20 "$tmp/gateway.log" >&2
	gateway_pid=
done
if [ $started != 1 ]; then
	echo "run.sh: could not start $gateway" >&2
	exit 1
fi

echo "run.sh: gateway pid $gateway_pid on 127.0.0.1:$port; store $store; $conns connections for $secs s"
# shellcheck disable=SC2086  # CG_BENCH_ARGS is a list of options
"$bench" --url "ws://127.0.0.1:$port/ws" --connections "$conns" --duration "$secs" \
	--pid "$gateway_pid" ${CG_BENCH_ARGS:-} | tee "$tmp/bench.out"
bench_status=${PIPESTATUS[0]}

# Graceful shutdown: SIGTERM, then the gateway must exit 0 on its own.
stop_status=0
if ! kill -0 "$gateway_pid" 2>/dev/null; then
	wait "$gateway_pid" 2>/dev/null
	echo "run.sh: the gateway died during the run (status $?); its log ends:" >&2
	tail -n 20 "$tmp/gateway.log" >&2
	stop_status=3
else
	kill -TERM "$gateway_pid"
	waited=0
	while kill -0 "$gateway_pid" 2>/dev/null && [ $waited -lt $((STOP_TIMEOUT * 10)) ]; do
		sleep 0.1
		waited=$((waited + 1))
	done
	if kill -0 "$gateway_pid" 2>/dev/null; then
		echo "run.sh: gateway still running ${STOP_TIMEOUT} s after SIGTERM; killing it" >&2
		stop_status=3
	else
		wait "$gateway_pid"
		gateway_status=$?
		echo "run.sh: gateway stopped on SIGTERM after $((waited / 10)).$((waited % 10)) s, status $gateway_status"
		if [ "$gateway_status" != 0 ]; then
			tail -n 20 "$tmp/gateway.log" >&2
			stop_status=3
		fi
		gateway_pid=
	fi
fi

if [ "$bench_status" != 0 ]; then
	echo "run.sh: cg_bench failed (status $bench_status); the gateway log ends:" >&2
	tail -n 20 "$tmp/gateway.log" >&2
	exit "$bench_status"
fi
grep '^RESULT ' "$tmp/bench.out"
if [ ${#cluster_pids[@]} -gt 0 ]; then
	# the masters' CPU over their whole life (start, create, warmup, the run): what Redis spent
	ticks=0
	for pid in "${cluster_pids[@]}"; do
		read -r -a st <"/proc/$pid/stat"
		ticks=$((ticks + st[13] + st[14]))
	done
	echo "CLUSTER masters=${#cluster_pids[@]} redis_cpu_s=$(awk -v t="$ticks" -v hz="$(getconf CLK_TCK)" 'BEGIN { printf "%.2f", t / hz }')"
fi
if [ -n "$redis_pid" ]; then
	# Every turn is one load and one save, each one script (EVALSHA, or EVAL: once on NOSCRIPT
	# now, every time before issue 11) in its own round trip: so the scripts are the round
	# trips, and half of them the turns (warmup included). commands counts every call Redis
	# ran, the scripts' own included (INFO commandstats counts those too).
	redis-cli -p "$redis_port" info commandstats | tr -d '\r' | awk -F'[:=,]' '
		/^cmdstat_/ { total += $3; if ($1 == "cmdstat_eval" || $1 == "cmdstat_evalsha") scripts += $3
		              if ($1 == "cmdstat_eval") evals = $3 }
		END {
			if (!scripts) { print "REDIS no scripts"; exit }
			printf "REDIS commands=%d scripts=%d (eval %d) turns=%d commands_per_message=%.1f round_trips_per_message=%.1f\n",
				total, scripts, evals, scripts / 2, total / (scripts / 2), 2
		}'
fi
exit "$stop_status"
