#!/usr/bin/env bash
# The gateway's own instructions per turn, counted by valgrind's callgrind: the figure to
# compare two builds by on a machine too noisy for timings (a shared VM, where the same
# binary's CPU per turn moves by half from one run to the next) and without hardware
# counters for perf. It counts user space only: the kernel's share (the sends and receives)
# is in compare.sh's CPU per turn, and in `strace -c -p PID`.
#
#   tests/bench/instructions.sh BUILD_DIR pass|full|stream|stream-rules [BINARY...]
#
# pass: the ws app upstream (app_backend), no rules, memory store; full: the shipped rules/
# and a Redis store (a redis-server started here). Each binary (default BUILD_DIR/chatgate)
# runs under callgrind with 10 connections of cg_bench; after 4 s the counts are zeroed, 8 s
# later dumped, and the turns the gateway counted in between (chatgate_turns_total, from
# /metrics) divide them. Prints one line a binary:
#   INSTR kind=pass binary=... turns=N instructions=N per_turn=N
# stream: a streamed reply's deltas instead (stream.sh's workload, under callgrind): an
# sse_server streaming 100 deltas a reply, one every 10 ms, as the OpenAI-compatible
# upstream, no rules, memory store, 50 streams of stream_bench; the deltas the server wrote
# in the window (its /stats) divide the count: per_delta=N (a turn's own work included, a
# hundredth of it a delta). stream-rules: the same with the shipped rules/ (the reply rule
# runs on every delta). CG_STREAM_TEXT sets a delta's text (sse_server's --text; its default
# "w12 " has digits, so the shipped card rule runs on every delta, where a delta of words
# passes the rules untouched: rules_reply.c). How many deltas one read brings moves with the
# machine's load, and with it what a delta costs by a few percent: compare the functions of
# a delta's path in CG_INSTR_KEEP's dumps (cg_sse_feed, cg_chunk_read) when that matters.
# CG_INSTR_KEEP=PATH keeps each binary's callgrind dump as PATH.<binary's name>, for
# callgrind_annotate. Needs valgrind (Debian's), curl, and redis-server for full.
set -u
. "$(dirname "$0")/ports.sh"

case ${2:-} in pass | full | stream | stream-rules) ;; *)
	echo "usage: $0 BUILD_DIR pass|full|stream|stream-rules [BINARY...]" >&2
	exit 2
	;;
esac
build=$(cd "$1" && pwd) kind=$2
shift 2
repo=$(cd "$(dirname "$0")/../.." && pwd)
binaries=("$@")
[ ${#binaries[@]} = 0 ] && binaries=("$build/chatgate")
for tool in valgrind callgrind_control callgrind_annotate curl; do
	command -v $tool >/dev/null || { echo "$0: $tool is needed (apt-get install valgrind curl)" >&2; exit 1; }
done
bench_workdir instructions

app_port=$(pick_free_port) || exit 1
"$build/tests/bench/app_backend" --port "$app_port" >"$tmp/app.log" 2>&1 &
pids+=($!)
mkdir -p "$tmp/norules"
rules=$tmp/norules store=memory
if [ "$kind" = full ]; then
	command -v redis-server >/dev/null || { echo "$0: redis-server is needed for full" >&2; exit 1; }
	redis_port=$(pick_free_port) || exit 1
	redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no --dir "$tmp" >"$tmp/redis.log" 2>&1 &
	pids+=($!)
	rules=$repo/rules store=redis://127.0.0.1:$redis_port
fi
bench_config "$app_port" >"$tmp/chatgate.json"
case $kind in stream*)
	sse_port=$(pick_free_port) || exit 1
	"$build/tests/bench/sse_server" --port "$sse_port" --deltas 100 --interval-ms 10 \
		${CG_STREAM_TEXT:+--text "$CG_STREAM_TEXT"} >"$tmp/sse.log" 2>&1 &
	pids+=($!)
	[ "$kind" = stream-rules ] && rules=$repo/rules
	cat >"$tmp/chatgate.json" <<EOF
{"upstreams":{"llm":{"url":"http://127.0.0.1:$sse_port/v1","model":"m","max_idle_connections":1024}},"default_upstream":"llm","rate_limit":{"messages_per_second":1000000,"burst":1000000},"max_connections":5000}
EOF
	;;
esac

status=0
for bin in "${binaries[@]}"; do
	port=$(pick_free_port) || exit 1
	valgrind --tool=callgrind --callgrind-out-file="$tmp/cg.out" "$bin" --listen "127.0.0.1:$port" \
		--config "$tmp/chatgate.json" --rules "$rules" --store "$store" >"$tmp/gw.log" 2>&1 &
	gw=$!
	pids+=($gw)
	for _ in $(seq 100); do curl -sf "http://127.0.0.1:$port/healthz" >/dev/null && break; sleep 0.3; done
	case $kind in
	stream*)
		"$build/tests/bench/stream_bench" --url "ws://127.0.0.1:$port/ws" --streams 50 --duration 14 --warmup 2 \
			>"$tmp/bench.out" 2>&1 &
		# the deltas the server wrote
		turns() { curl -s "http://127.0.0.1:$sse_port/stats" | sed -n 's/.*"deltas":\([0-9]*\).*/\1/p'; }
		;;
	*)
		"$build/tests/bench/cg_bench" --url "ws://127.0.0.1:$port/ws" --connections 10 --duration 14 --warmup 2 \
			--connect-timeout 30 >"$tmp/bench.out" 2>&1 &
		turns() { curl -s "http://127.0.0.1:$port/metrics" | awk '/^chatgate_turns_total/ { s += $2 } END { print s + 0 }'; }
		;;
	esac
	bench=$!
	sleep 4
	callgrind_control -z $gw >/dev/null 2>&1
	t0=$(turns)
	sleep 8
	t1=$(turns)
	callgrind_control -d $gw >/dev/null 2>&1
	wait $bench
	dump=$(ls -t "$tmp"/cg.out.* 2>/dev/null | head -n 1)
	ir=$(callgrind_annotate "$dump" 2>/dev/null | awk '/PROGRAM TOTALS/ { gsub(",", "", $1); print $1 }')
	[ -n "${CG_INSTR_KEEP:-}" ] && [ -n "$dump" ] && cp "$dump" "$CG_INSTR_KEEP.$(basename "$bin")"
	kill $gw 2>/dev/null
	wait $gw 2>/dev/null
	rm -f "$tmp"/cg.out*
	n=$((t1 - t0))
	if [ -z "$ir" ] || [ "$n" -le 0 ]; then
		echo "$0: $bin: no count (turns $n); gateway log:" >&2
		tail -n 5 "$tmp/gw.log" >&2
		status=1
		continue
	fi
	case $kind in
	stream*) echo "INSTR kind=$kind binary=$bin deltas=$n instructions=$ir per_delta=$((ir / n))" ;;
	*) echo "INSTR kind=$kind binary=$bin turns=$n instructions=$ir per_turn=$((ir / n))" ;;
	esac
done
exit $status
