# shellcheck shell=bash
# tests/bench/ports.sh: sourced by the bench scripts (run.sh, compare.sh, scaleout.sh,
# instructions.sh, script_cost.sh, script_floor.sh).
# port_is_open PORT: something accepts on 127.0.0.1:PORT.
# pick_free_port: prints a port nothing listens on (20000-32767, below Linux's ephemeral
#   ports, which an outgoing connection could take before the port is bound); 1 when 50
#   tries found none.
# bench_workdir NAME: makes $tmp, a new directory for NAME's files, and an empty $pids; at
#   exit (or SIGINT, SIGTERM), every process in $pids gets SIGTERM, then SIGKILL after 5 s,
#   and $tmp is removed (kept, and said, when bench_keep is set).
# bench_config APP_PORT: prints a gateway config with app_backend on APP_PORT as its ws://
#   upstream "app", and no rate limit a benchmark would meet.
# result FILE KEY: a field of the RESULT line of a load generator's output (cg_bench,
#   stream_bench).
# spread: numbers on stdin, one a line -> "LOWEST MEDIAN HIGHEST" ("- - -" for none).
# median COLUMN NAME: the median of one column of a path's runs in $tmp/runs (lines
#   "NAME ROUND ..."; "-" if none).
# bench_start NAME PORT COMMAND...: runs COMMAND in the background (its log in
#   $tmp/NAME.log), adds it to $pids, sets started_pid, and waits until PORT accepts; 1, with
#   the log's end, when it exits first or does not listen within 10 s.
# callgrind_redis PORT: starts a redis-server on 127.0.0.1:PORT under valgrind's callgrind
#   (its dumps $tmp/redis.cg.<pid>.*), adds it to $pids, sets started_pid, and waits (30 s at
#   most) until it answers; 1 when it does not.
# callgrind_count PID: dumps PID's counts (callgrind_control -d) and sets callgrind_total to
#   the instructions it ran since its last zero (callgrind_control -z), and callgrind_dump to
#   the dump's path (removed at the next count); 1 when there is none. (Not in a $(...): the
#   variables are the answer.)

port_is_open() {
	(exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

pick_free_port() {
	local port
	for _ in $(seq 1 50); do
		port=$((20000 + RANDOM % 12768))
		if ! port_is_open "$port"; then
			echo "$port"
			return 0
		fi
	done
	return 1
}

bench_workdir() {
	tmp=$(mktemp -d "${TMPDIR:-/tmp}/cg_$1.XXXXXX") || exit 1
	pids=()
	trap bench_cleanup EXIT
	trap 'exit 130' INT TERM
}

# shellcheck disable=SC2317  # called through the EXIT trap
bench_cleanup() {
	local p
	for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null; done
	for p in "${pids[@]}"; do
		for _ in $(seq 1 50); do
			kill -0 "$p" 2>/dev/null || break
			sleep 0.1
		done
		kill -KILL "$p" 2>/dev/null
		wait "$p" 2>/dev/null
	done
	if [ -n "${bench_keep:-}" ]; then
		echo "${0##*/}: kept $tmp" >&2
	else
		rm -rf "$tmp"
	fi
}

bench_config() {
	printf '{"upstreams":{"app":{"url":"ws://127.0.0.1:%s/app"}},"rate_limit":{"messages_per_second":1000000,"burst":1000000}}\n' "$1"
}

started_pid=
bench_start() {
	local name=$1 port=$2
	shift 2
	"$@" >"$tmp/$name.log" 2>&1 &
	started_pid=$!
	pids+=("$started_pid")
	for _ in $(seq 1 100); do
		if ! kill -0 "$started_pid" 2>/dev/null; then
			echo "${0##*/}: $name exited at start; its log ends:" >&2
			tail -n 10 "$tmp/$name.log" >&2
			return 1
		fi
		port_is_open "$port" && return 0
		sleep 0.1
	done
	echo "${0##*/}: $name did not listen on port $port within 10 s; its log ends:" >&2
	tail -n 10 "$tmp/$name.log" >&2
	return 1
}

result() {
	sed -n "s/^RESULT .*[ ]$2=\([^ ]*\).*/\1/p" "$1" | head -n 1
}

spread() {
	sort -g | awk '{ v[NR] = $1 } END { if (!NR) { print "- - -"; exit }
		print v[1], (NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2), v[NR] }'
}

median() {
	awk -v n="$2" -v col="$1" '$1 == n && $col != "-" { print $col }' "$tmp/runs" | spread | awk '{ print $2 }'
}

callgrind_redis() {
	valgrind --tool=callgrind --callgrind-out-file="$tmp/redis.cg.%p" redis-server --port "$1" \
		--bind 127.0.0.1 --save "" --appendonly no --dir "$tmp" >"$tmp/redis-cg.log" 2>&1 &
	started_pid=$!
	pids+=("$started_pid")
	for _ in $(seq 300); do
		redis-cli -p "$1" ping >/dev/null 2>&1 && return 0
		sleep 0.1
	done
	echo "${0##*/}: redis-server under valgrind did not answer on port $1 within 30 s" >&2
	return 1
}

callgrind_count() {
	[ -n "${callgrind_dump:-}" ] && rm -f "$callgrind_dump"
	callgrind_control -d "$1" >/dev/null 2>&1
	callgrind_dump=$(ls -t "$tmp"/redis.cg."$1".* 2>/dev/null | head -n 1)
	callgrind_total=$(awk '/^(summary|totals):/ { print $2; exit }' "$callgrind_dump" 2>/dev/null)
	[ -n "$callgrind_total" ]
}
