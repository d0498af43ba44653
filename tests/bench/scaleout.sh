#!/usr/bin/env bash
# Scale-out benchmark (issue 11): the same closed-loop load (cg_bench, demo upstream with no
# delay) against chatgate on Redis in three shapes, one after the other in one run, so their
# figures compare on this machine as it is now:
#   1w   one gateway, one worker, one Redis
#   2w   one gateway with --workers 2, one Redis
#   2gw  two gateways behind nothing, each its own cg_bench half of the connections, on
#        twemproxy (Debian's nutcracker) in front of two Redis
# For each: turns per second, p99 turn latency, and the gateway CPU seconds per 1,000 turns
# (utime+stime of the gateway processes, master and workers, from /proc over the run; as the
# turns spread evenly, it is also what each worker spends per 1,000 turns it serves: the
# figure that carries to a bigger machine), plus Redis commands per turn (INFO commandstats:
# the scripts the gateways sent, EVALSHA and EVAL).
#
#   tests/bench/scaleout.sh BUILD_DIR [CONNECTIONS] [SECONDS]
#
# The load generator runs on the same cores as the gateways and Redis: on a 2-core machine
# a second worker competes with it, so read the ratios, not the absolute figures.
set -u
build=${1:?usage: $0 BUILD_DIR [CONNECTIONS] [SECONDS]}
conns=${2:-100}
secs=${3:-10}
gateway=${CHATGATE_BIN:-$build/chatgate}
bench=$build/tests/bench/cg_bench
[ -x "$gateway" ] && [ -x "$bench" ] || { echo "scaleout.sh: build chatgate and cg_bench first" >&2; exit 1; }
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true

# shellcheck source=tests/bench/ports.sh
. "$(dirname "$0")/ports.sh"
bench_workdir scaleout

start_redis() { # PORT
	bench_start "redis-$1" "$1" redis-server --port "$1" --bind 127.0.0.1 --save "" --appendonly no --dir "$tmp" ||
		exit 1
}

start_gateway() { # PORT STORE [ARGS...]
	local port=$1 store=$2
	shift 2
	echo '{"upstreams":{"demo":{"url":"demo","delay_ms":0}},"rate_limit":{"messages_per_second":100000,"burst":100000},"max_connections":5000}' >"$tmp/config.json"
	bench_start "gw-$port" "$port" "$gateway" --listen "127.0.0.1:$port" --config "$tmp/config.json" --store "$store" "$@" ||
		exit 1
}

# CPU ticks (utime + stime) of a process and its children that are gateways (workers)
cpu_ticks() { # PID...
	local total=0 p
	for p in "$@"; do
		for q in "$p" $(cat /proc/"$p"/task/*/children 2>/dev/null); do
			[ -r "/proc/$q/stat" ] || continue
			total=$((total + $(awk '{print $14 + $15}' "/proc/$q/stat")))
		done
	done
	echo "$total"
}

evals() { # PORT...: the client's script commands so far
	local total=0 p
	for p in "$@"; do
		total=$((total + $(redis-cli -p "$p" info commandstats | awk -F'[:=,]' '/^cmdstat_(evalsha|eval):/ {s += $3} END {print s + 0}')))
	done
	echo "$total"
}

# run NAME PROCESSES GATEWAY_PIDS... -- URLS... -- REDIS_PORTS...
run() {
	local name=$1 procs=$2
	shift 2
	local gws=() urls=() rports=()
	while [ "$1" != -- ]; do gws+=("$1"); shift; done
	shift
	while [ "$1" != -- ]; do urls+=("$1"); shift; done
	shift
	rports=("$@")
	local per=$((conns / ${#urls[@]})) hz t0 e0 outs=() i=0
	hz=$(getconf CLK_TCK)
	t0=$(cpu_ticks "${gws[@]}")
	e0=$(evals "${rports[@]}")
	for u in "${urls[@]}"; do
		"$bench" --url "$u" --connections "$per" --duration "$secs" >"$tmp/$name-$i.out" 2>&1 &
		outs+=("$tmp/$name-$i.out")
		i=$((i + 1))
	done
	wait $(jobs -p | tail -n ${#urls[@]}) 2>/dev/null
	local t1 e1
	t1=$(cpu_ticks "${gws[@]}")
	e1=$(evals "${rports[@]}")
	local rate=0 msgs=0 p99=0
	for o in "${outs[@]}"; do
		local line
		line=$(grep '^RESULT' "$o" | head -1)
		[ -n "$line" ] || { echo "scaleout.sh: $name: cg_bench failed:" >&2; cat "$o" >&2; exit 1; }
		rate=$(awk -v a="$rate" -v l="$line" 'BEGIN {match(l, /msgs_per_sec=[0-9.]+/); print a + substr(l, RSTART + 13, RLENGTH - 13)}')
		msgs=$(awk -v a="$msgs" -v l="$line" 'BEGIN {match(l, /msgs=[0-9]+/); print a + substr(l, RSTART + 5, RLENGTH - 5)}')
		p99=$(awk -v a="$p99" -v l="$line" 'BEGIN {match(l, /p99_ms=[0-9.]+/); v = substr(l, RSTART + 7, RLENGTH - 7); print (v > a ? v : a)}')
	done
	# turns over the whole run (warm-up included) for CPU and commands: the measured msgs
	# scaled by the run's length is close enough; cg_bench's 1 s warm-up is in both
	awk -v n="$name" -v r="$rate" -v p="$p99" -v m="$msgs" -v ticks=$((t1 - t0)) -v hz="$hz" -v procs="$procs" \
		-v ev=$((e1 - e0)) -v s="$secs" 'BEGIN {
		turns = m * (s + 1) / s
		printf "SCALEOUT %-4s turns/s %8.1f  p99 %6.2f ms  gateway CPU %.3f s per 1000 turns (%d processes; each spends this on the turns it serves)  client commands/turn %.2f\n",
			n, r, p, ticks / hz / turns * 1000, procs, ev / turns }'
}

# 1 worker, one Redis
r1=$(pick_free_port); start_redis "$r1"
g1=$(pick_free_port); start_gateway "$g1" "redis://127.0.0.1:$r1"
gw1=$started_pid
run 1w 1 "$gw1" -- "ws://127.0.0.1:$g1/ws" -- "$r1"
kill -TERM "$gw1"; wait "$gw1" 2>/dev/null

# 2 workers, one Redis
g2=$(pick_free_port); start_gateway "$g2" "redis://127.0.0.1:$r1" --workers 2
gw2=$started_pid
sleep 0.5
run 2w 2 "$gw2" -- "ws://127.0.0.1:$g2/ws" -- "$r1"
kill -TERM "$gw2"; wait "$gw2" 2>/dev/null

# two gateways on twemproxy in front of two Redis
r2=$(pick_free_port); start_redis "$r2"
tp=$(pick_free_port)
cat >"$tmp/nutcracker.yml" <<EOF
chatgate:
  listen: 127.0.0.1:$tp
  hash: fnv1a_64
  distribution: modula
  hash_tag: "{}"
  redis: true
  timeout: 2000
  auto_eject_hosts: false
  servers:
   - 127.0.0.1:$r1:1
   - 127.0.0.1:$r2:1
EOF
nutcracker -c "$tmp/nutcracker.yml" -s "$(pick_free_port)" -o "$tmp/nutcracker.log" &
pids+=($!)
sleep 0.5
ga=$(pick_free_port); start_gateway "$ga" "redis://127.0.0.1:$tp"
gwa=$started_pid
gb=$(pick_free_port); start_gateway "$gb" "redis://127.0.0.1:$tp"
gwb=$started_pid
run 2gw 2 "$gwa" "$gwb" -- "ws://127.0.0.1:$ga/ws" "ws://127.0.0.1:$gb/ws" -- "$r1" "$r2"
