#!/usr/bin/env bash
# What a turn costs Redis, away from the machine's noise: with the gateway and Redis sharing
# a core (docs/state.md, "What the scripts cost Redis"), every µs of Redis's time a turn is
# one the gateway waits, and the benchmark's own figures move too much to see a change of a
# tenth.
#
#   tests/bench/script_cost.sh BUILD_DIR [BINARY...]
#
# For each binary (default BUILD_DIR/chatgate): app_backend, a redis-server and the gateway
# (the shipped rules/, Redis store) on free ports; cg_bench runs one connection for 3 s
# while `redis-cli monitor` records; then the commands the gateway sent (scripts and plain
# commands) are replayed, pipelined, into a fresh redis-server (resp_replay.py). The replay
# is run three times, each into a new server, and the best is kept. Prints one line a binary:
#   SCRIPTS binary=... turns=N usec_per_script=X calls_per_turn=Y cpu_us_per_turn=Z
# (turns: cg_bench's answered messages, no warm-up; usec_per_script: the scripts' own time, from INFO
# commandstats; calls_per_turn: the commands Redis ran a turn, the plain ones sent and those
# the scripts ran; cpu_us_per_turn: the replaying server's CPU over the replay, from
# /proc/PID/schedstat).
# Compare binaries in one run: the figures still move by a tenth between sittings.
# CG_SCRIPT_INSTR=1 replays once more into a redis-server under valgrind's callgrind and adds
# instructions_per_turn: the server's instructions over the replay (its reading of the
# commands included) divided by the turns, the same on every run, so a change of a few
# percent shows (needs valgrind). CG_SCRIPT_KEEP=PATH keeps each binary's callgrind dump as
# PATH.<binary's name>, for callgrind_annotate.
# Needs redis-server, redis-cli (Debian's redis-server and redis-tools), curl and python3.
set -u
. "$(dirname "$0")/ports.sh"

if [ $# -lt 1 ]; then
	echo "usage: $0 BUILD_DIR [BINARY...]" >&2
	exit 2
fi
build=$(cd "$1" && pwd)
shift
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
binaries=("$@")
[ ${#binaries[@]} = 0 ] && binaries=("$build/chatgate")
for tool in redis-server redis-cli curl python3; do
	command -v $tool >/dev/null || { echo "$0: $tool is needed (apt-get install redis-server redis-tools curl python3)" >&2; exit 1; }
done
bench_workdir script_cost

app_port=$(pick_free_port) || exit 1
bench_start app "$app_port" "$build/tests/bench/app_backend" --port "$app_port" || exit 1
bench_config "$app_port" >"$tmp/chatgate.json"

# The instructions a turn of $tmp/monitor.txt costs a redis-server under callgrind: counted
# from a zero after start-up to a dump after the replay, divided by the turns ($turns).
replay_instructions() {
	local port pid total
	command -v valgrind >/dev/null || { echo "$0: CG_SCRIPT_INSTR needs valgrind" >&2; echo 0; return 1; }
	port=$(pick_free_port) || return 1
	callgrind_redis "$port" || { echo 0; return 1; }
	pid=$started_pid
	callgrind_control -z "$pid" >/dev/null 2>&1
	python3 "$here/resp_replay.py" "$tmp/monitor.txt" "$port" >"$tmp/replay-cg.out" 2>&1
	total=
	callgrind_count "$pid" && total=$callgrind_total
	kill "$pid"
	wait "$pid" 2>/dev/null
	[ -n "${CG_SCRIPT_KEEP:-}" ] && [ -n "$total" ] && cp "$callgrind_dump" "$CG_SCRIPT_KEEP.$(basename "$bin")"
	rm -f "$tmp"/redis.cg."$pid"*
	[ -n "$total" ] || { echo "$0: the callgrind replay counted nothing" >&2; echo 0; return 1; }
	echo $((total / turns))
}

# A process's CPU time, in ns: its main thread's, from the scheduler (/proc/PID/schedstat),
# where /proc/PID/stat counts 10 ms ticks, a tenth of a replay's time. redis-server does its
# commands on that thread.
cpu_ns() {
	awk '{ print $1 }' "/proc/$1/schedstat"
}

status=0
for bin in "${binaries[@]}"; do
	redis_port=$(pick_free_port) || exit 1
	bench_start redis "$redis_port" redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no --dir "$tmp" || exit 1
	redis=$started_pid
	port=$(pick_free_port) || exit 1
	bench_start gateway "$port" "$bin" --listen "127.0.0.1:$port" --config "$tmp/chatgate.json" --rules "$repo/rules" \
		--store "redis://127.0.0.1:$redis_port" || exit 1
	gw=$started_pid
	for _ in $(seq 100); do curl -sf "http://127.0.0.1:$port/healthz" >/dev/null && break; sleep 0.1; done
	redis-cli -p "$redis_port" monitor >"$tmp/monitor.txt" 2>&1 &
	monitor=$!
	sleep 0.3
	"$build/tests/bench/cg_bench" --url "ws://127.0.0.1:$port/ws" --connections 1 --duration 3 --warmup 0 \
		>"$tmp/bench.out" 2>&1
	sleep 0.5
	kill $monitor $gw $redis 2>/dev/null
	wait $monitor $gw $redis 2>/dev/null
	best= calls= cpu= turns=$(result "$tmp/bench.out" msgs)
	[ -n "$turns" ] || turns=0
	for _ in 1 2 3; do
		replay_port=$(pick_free_port) || exit 1
		bench_start replay "$replay_port" redis-server --port "$replay_port" --bind 127.0.0.1 --save "" --appendonly no --dir "$tmp" || exit 1
		replay=$started_pid
		ns=$(cpu_ns "$replay")
		if ! python3 "$here/resp_replay.py" "$tmp/monitor.txt" "$replay_port" >"$tmp/replay.out" 2>&1; then
			cat "$tmp/replay.out" >&2
			kill $replay
			status=1
			break
		fi
		ns=$(($(cpu_ns "$replay") - ns))
		stats=$(redis-cli -p "$replay_port" info commandstats | tr -d '\r')
		kill $replay
		wait $replay 2>/dev/null
		# cmdstat_<name>:calls=N,usec=N,usec_per_call=X,...: the scripts' own time, and the
		# commands run (everything but the scripts, PING and INFO)
		read -r u c n <<<"$(awk -F'[:,=]' '
			/^cmdstat_(evalsha|eval):/ { scripts += $3; usec += $5 }
			/^cmdstat_/ && !/^cmdstat_(evalsha|eval|ping|info):/ { inner += $3 }
			END { printf "%.2f %d %d\n", scripts ? usec / scripts : 0, inner, scripts }' <<<"$stats")"
		if [ "$n" -gt 0 ] && { [ -z "$best" ] || awk "BEGIN { exit !($u < $best) }"; }; then
			best=$u calls=$c
		fi
		# the replay's CPU: its best, as the scripts' time
		if [ -z "$cpu" ] || [ "$ns" -lt "$cpu" ]; then
			cpu=$ns
		fi
	done
	if [ -z "$best" ] || [ "$turns" -eq 0 ]; then
		echo "SCRIPTS binary=$bin failed (no script was replayed; see $tmp, kept)" >&2
		bench_keep=1
		status=1
		continue
	fi
	instr=
	if [ -n "${CG_SCRIPT_INSTR:-}" ]; then
		instr=" instructions_per_turn=$(replay_instructions)" || status=1
	fi
	echo "SCRIPTS binary=$bin turns=$turns usec_per_script=$best calls_per_turn=$(awk "BEGIN { printf \"%.1f\", $calls / $turns }")" \
		"cpu_us_per_turn=$(awk "BEGIN { printf \"%.1f\", $cpu / 1000 / $turns }")$instr"
done
exit $status
