#!/usr/bin/env bash
# The streaming benchmark of issue 39: what relaying a model's streamed reply costs chatgate,
# per delta, beside nginx relaying the same server-sent events, in one run on one machine.
#
#   tests/bench/stream.sh BUILD_DIR [STREAMS] [INTERVAL_MS] [SECONDS] [ROUNDS]
#   tests/bench/stream.sh --fast BUILD_DIR [SECONDS] [ROUNDS]     (20 streams, interval 0)
#
# One sse_server (tests/bench/sse_server.c: an OpenAI-compatible server in C, DELTAS deltas a
# reply, a few bytes each plus a stamp of its write time, one write() per delta, one every
# INTERVAL_MS ms, or as fast as the socket takes with 0) behind every path, each driven by
# stream_bench (tests/bench/stream_bench.c) with STREAMS connections, one reply in flight
# each (closed loop):
#
#   direct          the SSE client straight to the server: the floor of this machine
#   nginx           Debian's nginx, one process (master_process off), proxy_pass to the
#                   server with HTTP/1.1 upstream keepalive and proxy_buffering off; the
#                   SSE client
#   chatgate-pass   chatgate with the server as its OpenAI-compatible upstream, no rules (an
#                   empty --rules dir), memory store; the chatgate.v1 client
#   chatgate-rules  the same with the shipped rules/ (the message rules, and the reply rule
#                   90-replies.rules, which runs on every delta)
#
# Defaults: 200 streams, 10 ms, SECONDS 8 (each measured window, after a 1 s warmup), 3
# ROUNDS; --fast: 20 streams, interval 0. The rounds interleave the paths (each round starts
# one path later) because a shared machine is noisy; the table gives each path's medians over
# the rounds of: deltas/s; the proxy's CPU per delta (user + system time of its process from
# /proc/PID/stat over the window, divided by the deltas the client read in it) and its ratio
# to nginx's; the delay of a delta from the server's write() to the client's read() (the
# stamps: p50 and p99) and what that adds over the direct path's; the p99 of the gap between
# two deltas of one reply; the server's and the client's CPU (% of one core) and the machine's
# idle CPU time, so that a reader sees who was the limit. A second table gives each round's
# ratios (chatgate to nginx, rules to no rules), lowest, median and highest.
#
# Environment:
#   CHATGATE_BIN      gateway binary (default BUILD_DIR/chatgate)
#   CHATGATE_BIN_B    a second gateway binary: adds the paths chatgate-pass(B), chatgate-rules(B)
#                     (before/after in one run)
#   STREAM_DELTAS     deltas a reply (default 100)
#   STREAM_PATHS      the paths to run, space-separated (default: all four)
#   STREAM_KEEP=1     keep the temporary directory (configs, logs, every stream_bench output)
#
# Exit status: 0 when every run gave a result; 1 when one did not; 2 on bad arguments.
set -u

usage() {
	echo "usage: $0 BUILD_DIR [STREAMS] [INTERVAL_MS] [SECONDS] [ROUNDS]" >&2
	echo "       $0 --fast BUILD_DIR [SECONDS] [ROUNDS]" >&2
	exit 2
}

if [ "${1:-}" = --fast ]; then
	shift
	{ [ $# -ge 1 ] && [ $# -le 3 ]; } || usage
	build_dir=$1 streams=20 interval=0 secs=${2:-8} rounds=${3:-3}
else
	{ [ $# -ge 1 ] && [ $# -le 5 ]; } || usage
	build_dir=$1 streams=${2:-200} interval=${3:-10} secs=${4:-8} rounds=${5:-3}
fi
deltas=${STREAM_DELTAS:-100}
case $streams in '' | *[!0-9]* | 0) usage ;; esac
case $interval in '' | *[!0-9.]*) usage ;; esac
case $secs in '' | *[!0-9.]*) usage ;; esac
case $rounds in '' | *[!0-9]* | 0) usage ;; esac
case $deltas in '' | *[!0-9]* | 0) usage ;; esac

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
gateway=${CHATGATE_BIN:-$build_dir/chatgate}
bench=$build_dir/tests/bench/stream_bench
server=$build_dir/tests/bench/sse_server
for f in "$gateway" "$bench" "$server"; do
	if [ ! -x "$f" ]; then
		echo "stream.sh: no executable $f (build the targets chatgate, stream_bench, sse_server)" >&2
		exit 2
	fi
done

# shellcheck source=tests/bench/ports.sh
. "$here/ports.sh"
[ "${STREAM_KEEP:-0}" = 1 ] && bench_keep=1
bench_workdir stream

ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
fd_limit=$(ulimit -n)


wanted=" ${STREAM_PATHS:-direct nginx chatgate-pass chatgate-rules} "
wants() { case $wanted in *" $1 "*) return 0 ;; esac; return 1; }

# ---- the server ----
server_port=$(pick_free_port) || exit 1
bench_start sse_server "$server_port" "$server" --port "$server_port" --deltas "$deltas" \
	--interval-ms "$interval" || exit 1
server_pid=$started_pid
server_url="http://127.0.0.1:$server_port"

# paths: name, url, the proxy's pid ("" for none), description
path_names=()
declare -A path_url path_pid path_desc
add_path() {
	path_names+=("$1")
	path_url[$1]=$2
	path_pid[$1]=$3
	path_desc[$1]=$4
}

wants direct && add_path direct "$server_url/v1/chat/completions" "" "SSE client straight to the server"

# ---- nginx: one process, as one event loop beside chatgate's ----
if wants nginx; then
	nginx_bin=$(command -v nginx || echo /usr/sbin/nginx)
	if [ ! -x "$nginx_bin" ]; then
		echo "stream.sh: no nginx (scripts/deps.sh bench installs it); leaving the nginx path out" >&2
	else
		port=$(pick_free_port) || exit 1
		dir=$tmp/nginx
		mkdir -p "$dir/tmp"
		version=$("$nginx_bin" -v 2>&1 | sed -n 's|.*nginx/\([0-9.]*\).*|\1|p')
		cat >"$dir/nginx.conf" <<EOF
daemon off;
master_process off;
worker_processes 1;
worker_rlimit_nofile $fd_limit;
pid $dir/nginx.pid;
error_log $dir/error.log warn;
events { worker_connections $((fd_limit - 64)); multi_accept on; }
http {
	access_log off;
	client_body_temp_path $dir/tmp/body;
	proxy_temp_path $dir/tmp/proxy;
	fastcgi_temp_path $dir/tmp/fastcgi;
	uwsgi_temp_path $dir/tmp/uwsgi;
	scgi_temp_path $dir/tmp/scgi;
	keepalive_requests 1000000;
	keepalive_timeout 1h;
	upstream llm {
		server 127.0.0.1:$server_port;
		keepalive 1024;
		keepalive_requests 1000000;
		keepalive_timeout 1h;
	}
	server {
		listen 127.0.0.1:$port;
		location / {
			proxy_pass http://llm;
			proxy_http_version 1.1;
			proxy_set_header Connection "";
			proxy_buffering off;
			proxy_read_timeout 1h;
			proxy_send_timeout 1h;
		}
	}
}
EOF
		if bench_start nginx "$port" "$nginx_bin" -p "$dir" -e "$dir/error.log" -c "$dir/nginx.conf"; then
			add_path nginx "http://127.0.0.1:$port/v1/chat/completions" "$started_pid" \
				"nginx ${version:-?}, one process, proxy_buffering off; SSE client"
		else
			echo "stream.sh: leaving the nginx path out" >&2
		fi
	fi
fi

# ---- chatgate ----
mkdir -p "$tmp/norules"
max_connections=$((streams + 100))
[ $max_connections -lt 5000 ] && max_connections=5000
cat >"$tmp/chatgate.json" <<EOF
{"upstreams":{"llm":{"url":"$server_url/v1","model":"m","max_idle_connections":1024}},"default_upstream":"llm","rate_limit":{"messages_per_second":1000000,"burst":1000000},"max_connections":$max_connections}
EOF
start_chatgate() {
	local name=$1 rules=$2 desc=$3 bin=${4:-$gateway} port
	port=$(pick_free_port) || return 1
	if bench_start "$name" "$port" "$bin" --listen "127.0.0.1:$port" --config "$tmp/chatgate.json" \
		--rules "$rules" --store memory; then
		add_path "$name" "ws://127.0.0.1:$port/ws" "$started_pid" "$desc"
	else
		echo "stream.sh: leaving $name out" >&2
	fi
}
wants chatgate-pass && start_chatgate chatgate-pass "$tmp/norules" "chatgate, no rules, memory store; chatgate.v1 client"
wants chatgate-rules && start_chatgate chatgate-rules "$repo/rules" "chatgate, shipped rules, memory store; chatgate.v1 client"
if [ -n "${CHATGATE_BIN_B:-}" ]; then
	wants chatgate-pass && start_chatgate "chatgate-pass(B)" "$tmp/norules" \
		"chatgate (B), no rules, memory store; chatgate.v1 client" "$CHATGATE_BIN_B"
	wants chatgate-rules && start_chatgate "chatgate-rules(B)" "$repo/rules" \
		"chatgate (B), shipped rules, memory store; chatgate.v1 client" "$CHATGATE_BIN_B"
fi

if [ ${#path_names[@]} = 0 ]; then
	echo "stream.sh: no path to run" >&2
	exit 1
fi

# server_quiet: waits (at most 5 s) until the server has no stream in flight, so that a
# path's run does not meet the end of the one before
server_quiet() {
	local answer
	for _ in $(seq 1 50); do
		answer=$( (exec 3<>"/dev/tcp/127.0.0.1/$server_port" &&
			printf 'GET /stats HTTP/1.1\r\nHost: x\r\n\r\n' >&3 && cat <&3) 2>/dev/null)
		case $answer in *'"streams":0,'*) return 0 ;; esac
		sleep 0.1
	done
	echo "stream.sh: the server still has streams in flight after 5 s" >&2
}

if [ "$interval" = 0 ]; then
	what="as fast as they come"
else
	what="a delta every $interval ms each"
fi
echo "stream.sh: $streams streams, $what, $deltas deltas a reply; $secs s x $rounds rounds per path" >&2
: >"$tmp/runs"
status=0
n_paths=${#path_names[@]}
for round in $(seq 1 "$rounds"); do
	for k in $(seq 0 $((n_paths - 1))); do
		name=${path_names[$(((k + round - 1) % n_paths))]}
		out="$tmp/run-$round-$name.out"
		pid_opt=()
		[ -n "${path_pid[$name]}" ] && pid_opt=(--pid "${path_pid[$name]}")
		server_quiet
		"$bench" --url "${path_url[$name]}" --streams "$streams" --duration "$secs" --warmup 1 \
			--server-pid "$server_pid" "${pid_opt[@]}" >"$out" 2>"$out.err"
		rate=$(result "$out" deltas_per_sec)
		if [ -z "$rate" ] || [ "$(result "$out" deltas)" = 0 ]; then
			echo "stream.sh: round $round $name: no result; stream_bench said:" >&2
			tail -n 5 "$out.err" >&2
			status=1
			continue
		fi
		window=$(result "$out" window_s)
		cpu=$(result "$out" proxy_us_per_delta)
		[ "${cpu#-}" != "$cpu" ] && cpu=-
		pct() { awk -v c="$1" -v w="$window" 'BEGIN { if (c < 0 || w <= 0) print "-"; else printf "%.1f", 100 * c / w }'; }
		# name round rate cpu_per_delta p50 p99 gap_p99 server% client% idle errors
		printf '%s %s %s %s %s %s %s %s %s %s %s\n' "$name" "$round" "$rate" "$cpu" \
			"$(result "$out" delay_p50_ms)" "$(result "$out" delay_p99_ms)" "$(result "$out" gap_p99_ms)" \
			"$(pct "$(result "$out" server_cpu_s)")" "$(pct "$(result "$out" client_cpu_s)")" \
			"$(result "$out" machine_idle_pct)" "$(result "$out" errors)" >>"$tmp/runs"
		printf 'stream.sh: round %s %-15s %8.0f deltas/s  CPU %s µs/delta  delay p50 %s p99 %s ms  gap p99 %s ms  server %s%%  client %s%%  idle %s%%  errors %s\n' \
			"$round" "$name" "$rate" "$cpu" "$(result "$out" delay_p50_ms)" "$(result "$out" delay_p99_ms)" \
			"$(result "$out" gap_p99_ms)" "$(pct "$(result "$out" server_cpu_s)")" \
			"$(pct "$(result "$out" client_cpu_s)")" "$(result "$out" machine_idle_pct)" "$(result "$out" errors)" >&2
		sleep 0.5
	done
done

nginx_cpu=$(median 4 nginx)
direct_p50=$(median 5 direct)
direct_p99=$(median 6 direct)
echo
echo "$streams streams, $what, $deltas deltas a reply; $secs s x $rounds rounds, medians; client, server and proxy on the same machine ($(nproc) CPUs)"
echo
echo "| path | deltas/s | proxy CPU per delta | x nginx | delay p50 | delay p99 | added p50 | added p99 | gap p99 | server CPU | client CPU | CPUs idle |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|"
for name in "${path_names[@]}"; do
	awk -v d="${path_desc[$name]}" -v name="$name" -v r="$(median 3 "$name")" -v cpu="$(median 4 "$name")" \
		-v p50="$(median 5 "$name")" -v p99="$(median 6 "$name")" -v gap="$(median 7 "$name")" \
		-v srv="$(median 8 "$name")" -v cli="$(median 9 "$name")" -v idle="$(median 10 "$name")" \
		-v ng="$nginx_cpu" -v d50="$direct_p50" -v d99="$direct_p99" '
	function commas(n,   s) { s = sprintf("%d", n); while (s ~ /[0-9][0-9][0-9][0-9]/) sub(/[0-9][0-9][0-9]($|,)/, ",&", s); return s }
	function msf(v) { return v == "-" ? "-" : sprintf("%.3f ms", v) }
	function pc(v) { return v == "-" ? "-" : sprintf("%.0f%%", v) }
	BEGIN {
		if (r == "-") { printf "| %s | - | - | - | - | - | - | - | - | - | - | - |\n", d; exit }
		c = (cpu == "-") ? "-" : sprintf("%.1f µs", cpu)
		x = (cpu == "-" || ng == "-" || ng == 0) ? "-" : sprintf("x%.2f", cpu / ng)
		a50 = (name == "direct" || d50 == "-") ? "-" : sprintf("%+.3f ms", p50 - d50)
		a99 = (name == "direct" || d99 == "-") ? "-" : sprintf("%+.3f ms", p99 - d99)
		printf "| %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s | %s |\n", d, commas(r + 0.5), c, x,
			msf(p50), msf(p99), a50, a99, msf(gap), pc(srv), pc(cli), pc(idle)
	}'
done

# each round's ratios of CPU per delta: chatgate to the same round's nginx, rules to no rules
ratio_row() { # LABEL NAME REFERENCE
	local lo mid hi
	read -r lo mid hi < <(awk -v n="$2" -v ref="$3" '$1 == ref && $4 != "-" { a[$2] = $4 }
		$1 == n && $4 != "-" { b[$2] = $4 } END { for (k in b) if (a[k] > 0) print b[k] / a[k] }' "$tmp/runs" | spread)
	[ "$lo" = - ] && return 0
	awk -v l="$1" -v a="$lo" -v b="$mid" -v c="$hi" 'BEGIN { printf "| %s | x%.2f | x%.2f | x%.2f |\n", l, a, b, c }'
}
echo
echo "| CPU per delta, by round | lowest | median | highest |"
echo "|---|---|---|---|"
ratio_row "chatgate, no rules / nginx" chatgate-pass nginx
ratio_row "chatgate, shipped rules / nginx" chatgate-rules nginx
ratio_row "shipped rules / no rules" chatgate-rules chatgate-pass
ratio_row "chatgate, no rules / (B)" chatgate-pass "chatgate-pass(B)"
ratio_row "chatgate, shipped rules / (B)" chatgate-rules "chatgate-rules(B)"
echo
echo "(proxy CPU per delta: user + system time of the proxy's process over the window, from /proc/PID/stat, over the deltas the client read in it)"
echo "(delay: from the server's write() of a delta to the client's read() of it, by the stamp in its text; added: the path's p50 and p99 less the direct path's)"
echo "(gap: between the arrivals of two deltas of one reply; server and client CPU: % of one core over the window; CPUs idle: /proc/stat, every CPU)"
exit $status
