#!/usr/bin/env bash
# Compare chatgate with the reference points of issue 12 in one run, on one machine: the
# same load generator (cg_bench, closed loop) and the same chat app (app_backend: two deltas
# and a done per message) behind every path:
#
#   direct         the client straight to the app (cg_bench --raw)
#   nginx          nginx (Debian package), one process, proxying the WebSocket to the app
#   node           node_relay.js: Node and the `ws` package, one upstream socket per client
#   chatgate-pass  chatgate, ws:// app upstream, no rules (an empty --rules dir), memory store
#   chatgate-full  chatgate, ws:// app upstream, the shipped rules/, Redis store (a
#                  redis-server started here on a free port)
#   nginx-auto     nginx as in production: worker_processes auto, under its master
#   chatgate-full-auto  chatgate-full with --workers auto, under its master: one process per
#                  CPU on both sides, compared with nginx-auto (its "vs nginx" and the
#                  second table's ratios are to nginx-auto; nginx-auto's own to nginx)
#
#   tests/bench/compare.sh BUILD_DIR [CONNECTIONS] [SECONDS] [ROUNDS]
#   tests/bench/compare.sh --idle BUILD_DIR [N]
#
# CONNECTIONS defaults to 100, SECONDS (each measured window, after a 1 s warmup) to 10,
# ROUNDS to 3. The rounds interleave the paths (round 1 runs every path, then round 2 ...,
# each round starting one path later) because a shared machine is noisy; the table gives
# each path's median over the rounds of turns/s, p50 and p99, its ratio to nginx's turns/s,
# the p50 it adds over the direct path (run with CONNECTIONS=1 for the per-hop latency), and
# the proxy's CPU per 1,000 turns (user + system time of the proxy process over the window,
# from /proc/PID/stat: nginx runs as one process, master_process off; node is one process;
# the -auto paths count the master's and its workers'), the redis-server's CPU per turn on
# the paths with Redis (the same over the window, divided by the turns), and how much of the
# machine's CPU time was idle over the window (/proc/stat, every CPU).
# A second table gives each path's ratio to the nginx run of its own round, lowest, median
# and highest: nginx moves within one run, and those ratios are taken closest in time.
#
# --idle measures memory instead: N (default 10000) connections are opened to each proxy and
# held idle (chatgate: after its hello; the others: once open), and the proxy's VmRSS growth
# is divided by the connections; then they close, and the RSS once it settles is given beside
# the RSS before (what the process kept of them). nginx and node hold two sockets per client (client and
# app), so they get at most half the descriptor limit.
#
# Environment:
#   CHATGATE_BIN     gateway binary (default BUILD_DIR/chatgate)
#   CHATGATE_BIN_B   a second gateway binary: adds the rows chatgate-pass(B), chatgate-full(B)
#                    (before/after in one run)
#   CHATGATE_RULES_B the rules directory of chatgate-full(B) (default: the repo's rules/), to
#                    weigh a change of the rules the same way (CHATGATE_BIN_B may be the same
#                    binary)
#   CG_COMPARE_PATHS the paths to run, space-separated (default: all of them)
#   CG_COMPARE_KEEP=1 keep the temporary directory (configs, logs, every cg_bench output)
#
# A path whose program is missing (nginx, node, redis-server) is left out with a note.
# Exit status: 0 when every run gave a result; 1 when one did not (its cells show "-");
# 2 on bad arguments.
set -u

usage() {
	echo "usage: $0 BUILD_DIR [CONNECTIONS] [SECONDS] [ROUNDS]" >&2
	echo "       $0 --idle BUILD_DIR [N]" >&2
	exit 2
}

mode=load
if [ "${1:-}" = --idle ]; then
	mode=idle
	shift
fi
[ $# -ge 1 ] || usage
build_dir=$1
if [ $mode = load ]; then
	[ $# -le 4 ] || usage
	conns=${2:-100}
	secs=${3:-10}
	rounds=${4:-3}
	case $conns in '' | *[!0-9]* | 0) usage ;; esac
	case $secs in '' | *[!0-9.]*) usage ;; esac
	case $rounds in '' | *[!0-9]* | 0) usage ;; esac
else
	[ $# -le 2 ] || usage
	idle_n=${2:-10000}
	case $idle_n in '' | *[!0-9]* | 0) usage ;; esac
fi

here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
gateway=${CHATGATE_BIN:-$build_dir/chatgate}
gateway_b=${CHATGATE_BIN_B:-}
bench=$build_dir/tests/bench/cg_bench
app=$build_dir/tests/bench/app_backend
for f in "$gateway" "$bench" "$app" ${gateway_b:+"$gateway_b"}; do
	if [ ! -x "$f" ]; then
		echo "compare.sh: no executable $f (build the targets chatgate, cg_bench, app_backend)" >&2
		exit 2
	fi
done

# shellcheck source=tests/bench/ports.sh
. "$(dirname "$0")/ports.sh"
[ "${CG_COMPARE_KEEP:-0}" = 1 ] && bench_keep=1
bench_workdir compare

# Many connections need many descriptors: cg_bench, the proxies and the app inherit this.
ulimit -n "$(ulimit -Hn)" 2>/dev/null || true
fd_limit=$(ulimit -n)


if [ $mode = idle ]; then
	max_connections=$((idle_n + 100))
else
	max_connections=$((conns + 100))
	[ $max_connections -lt 5000 ] && max_connections=5000
fi
wanted=" ${CG_COMPARE_PATHS:-direct nginx node chatgate-pass chatgate-full nginx-auto chatgate-full-auto} "
wants() { case $wanted in *" $1 "*) return 0 ;; esac; return 1; }

# ---- the app ----
app_port=$(pick_free_port) || exit 1
bench_start app "$app_port" "$app" --port "$app_port" || exit 1
app_pid=$started_pid
app_url="ws://127.0.0.1:$app_port/app"

# paths: name, url, pid whose CPU is the proxy's ("" for none), cg_bench options, description
path_names=()
declare -A path_url path_pid path_opts path_desc

add_path() {
	path_names+=("$1")
	path_url[$1]=$2
	path_pid[$1]=$3
	path_opts[$1]=$4
	path_desc[$1]=$5
}

if wants direct; then
	add_path direct "ws://127.0.0.1:$app_port/app" "" --raw "client straight to the app"
fi

# ---- nginx ----
# start_nginx NAME one|auto: one process (no master), as a single-threaded proxy beside
# chatgate's one event loop; or worker_processes auto under its master, as in production
start_nginx() {
	local name=$1 procs=$2 port dir conns version desc
	nginx_bin=$(command -v nginx || echo /usr/sbin/nginx)
	if [ ! -x "$nginx_bin" ]; then
		echo "compare.sh: no nginx (scripts/deps.sh bench installs it); leaving the $name path out" >&2
		return 0
	fi
	port=$(pick_free_port) || exit 1
	dir=$tmp/$name
	mkdir -p "$dir/tmp"
	conns=$((fd_limit - 64)) # counts client and app sockets both
	version=$("$nginx_bin" -v 2>&1 | sed -n 's|.*nginx/\([0-9.]*\).*|\1|p')
	if [ "$procs" = auto ]; then
		procs="master_process on;
worker_processes auto;"
		desc="nginx ${version:-?}, worker_processes auto ($(nproc) CPUs), proxying WebSocket"
	else
		procs="master_process off;
worker_processes 1;"
		desc="nginx ${version:-?}, one process, proxying WebSocket"
	fi
	cat >"$dir/nginx.conf" <<EOF
daemon off;
$procs
worker_rlimit_nofile $fd_limit;
pid $dir/nginx.pid;
error_log $dir/error.log warn;
events { worker_connections $conns; multi_accept on; }
http {
	access_log off;
	client_body_temp_path $dir/tmp/body;
	proxy_temp_path $dir/tmp/proxy;
	fastcgi_temp_path $dir/tmp/fastcgi;
	uwsgi_temp_path $dir/tmp/uwsgi;
	scgi_temp_path $dir/tmp/scgi;
	server {
		listen 127.0.0.1:$port;
		location / {
			proxy_pass http://127.0.0.1:$app_port;
			proxy_http_version 1.1;
			proxy_set_header Upgrade \$http_upgrade;
			proxy_set_header Connection "upgrade";
			proxy_read_timeout 1h;
			proxy_send_timeout 1h;
		}
	}
}
EOF
	if ! bench_start "$name" "$port" "$nginx_bin" -p "$dir" -e "$dir/error.log" -c "$dir/nginx.conf"; then
		echo "compare.sh: leaving the $name path out" >&2
		return 0
	fi
	# the master's pid: cg_bench counts its workers' CPU with its own
	add_path "$name" "ws://127.0.0.1:$port/app" "$started_pid" --raw "$desc"
}
wants nginx && start_nginx nginx one
wants nginx-auto && start_nginx nginx-auto auto

# ---- the Node relay ----
if wants node; then
	if ! command -v node >/dev/null; then
		echo "compare.sh: no node; leaving the node path out" >&2
	else
		if [ ! -d "$here/node_modules/ws" ]; then
			echo "compare.sh: npm install in $here (the ws package)" >&2
			(cd "$here" && npm install --no-audit --no-fund >"$tmp/npm.log" 2>&1) ||
				{ echo "compare.sh: npm install failed:" >&2; tail -n 5 "$tmp/npm.log" >&2; }
		fi
		node_port=$(pick_free_port) || exit 1
		if [ -d "$here/node_modules/ws" ] &&
			bench_start node "$node_port" node "$here/node_relay.js" "$node_port" "$app_url"; then
			add_path node "ws://127.0.0.1:$node_port/app" "$started_pid" --raw \
				"Node $(node --version) relay on ws $(node -p 'require(process.argv[1]).version' "$here/node_modules/ws/package.json" 2>/dev/null)"
		else
			echo "compare.sh: leaving the node path out" >&2
		fi
	fi
fi

# ---- chatgate ----
mkdir -p "$tmp/norules"
cat >"$tmp/chatgate.json" <<EOF
{"upstreams":{"app":{"url":"$app_url"}},"rate_limit":{"messages_per_second":1000000,"burst":1000000},"max_connections":$max_connections}
EOF
redis_store= redis_pid=
if wants chatgate-full || wants chatgate-full-auto; then
	if ! command -v redis-server >/dev/null; then
		echo "compare.sh: no redis-server; leaving chatgate-full out" >&2
	else
		redis_port=$(pick_free_port) || exit 1
		if bench_start redis "$redis_port" redis-server --port "$redis_port" --bind 127.0.0.1 --save "" \
			--appendonly no --dir "$tmp"; then
			redis_store="redis://127.0.0.1:$redis_port"
			redis_pid=$started_pid
		fi
	fi
fi

# start_chatgate NAME BINARY full|pass|auto [SUFFIX [RULES]]  (auto: full, --workers auto)
start_chatgate() {
	local name=$1 bin=$2 kind=$3 port rules store desc workers=()
	if [ "$kind" != pass ]; then
		[ -n "$redis_store" ] || return 0
		rules=${5:-$repo/rules} store=$redis_store desc="shipped rules, Redis store"
		[ -n "${5:-}" ] && desc="rules of $5, Redis store"
	else
		rules=$tmp/norules store=memory desc="no rules, memory store"
	fi
	[ "$kind" = auto ] && workers=(--workers auto) desc="--workers auto ($(nproc) CPUs), $desc"
	port=$(pick_free_port) || return 1
	if bench_start "$name" "$port" "$bin" --listen "127.0.0.1:$port" --config "$tmp/chatgate.json" \
		--rules "$rules" --store "$store" "${workers[@]}"; then
		add_path "$name" "ws://127.0.0.1:$port/ws" "$started_pid" "" "chatgate${4:-}, ws app upstream, $desc"
	else
		echo "compare.sh: leaving $name out" >&2
	fi
}
wants chatgate-pass && start_chatgate chatgate-pass "$gateway" pass
wants chatgate-full && start_chatgate chatgate-full "$gateway" full
wants chatgate-full-auto && start_chatgate chatgate-full-auto "$gateway" auto
if [ -n "$gateway_b" ]; then
	wants chatgate-pass && start_chatgate "chatgate-pass(B)" "$gateway_b" pass " (B)"
	wants chatgate-full && start_chatgate "chatgate-full(B)" "$gateway_b" full " (B)" "${CHATGATE_RULES_B:-}"
fi

if [ ${#path_names[@]} = 0 ]; then
	echo "compare.sh: no path to run" >&2
	exit 1
fi

# ---- idle: memory per connection ----

# The process's VmRSS once its closed connections are gone: wait (at most 30 s) until it holds
# no more descriptors than $2, then read every 0.5 s until two reads agree (at most 10 s).
rss_settled_kb() {
	local last=-1 now k
	for k in $(seq 1 300); do
		[ "$(ls "/proc/$1/fd" 2>/dev/null | wc -l)" -le "$2" ] && break
		sleep 0.1
	done
	for k in $(seq 1 20); do
		now=$(awk '/^VmRSS:/ { print $2 }' "/proc/$1/status" 2>/dev/null)
		[ "$now" = "$last" ] && break
		last=$now
		sleep 0.5
	done
	echo "${now:-0}"
}

if [ $mode = idle ]; then
	echo "compare.sh: $idle_n idle connections per path; fd limit $fd_limit"
	echo
	echo "| path | connections | RSS before | RSS with all up | KiB per connection | RSS once all closed | over before |"
	echo "|---|---|---|---|---|---|---|"
	status=0
	for name in "${path_names[@]}"; do
		n=$idle_n
		pid=${path_pid[$name]}
		[ "$name" = direct ] && pid=$app_pid
		case $name in
		nginx | node) # two sockets per client, and the app holds one more
			[ "$n" -gt $((fd_limit / 2 - 100)) ] && n=$((fd_limit / 2 - 100)) ;;
		*) [ "$n" -gt $((fd_limit - 100)) ] && n=$((fd_limit - 100)) ;;
		esac
		out=$tmp/idle-$name.out
		fds_before=$(ls "/proc/$pid/fd" | wc -l)
		# shellcheck disable=SC2086  # the path's options are a list
		"$bench" --url "${path_url[$name]}" --connections "$n" --idle 3 --connect-timeout 60 \
			--pid "$pid" ${path_opts[$name]} >"$out" 2>"$out.err"
		ready=$(result "$out" ready)
		if [ -z "$ready" ] || [ "$ready" = 0 ]; then
			echo "compare.sh: $name: no result; cg_bench said:" >&2
			tail -n 5 "$out.err" >&2
			status=1
			continue
		fi
		closed_kb=$(rss_settled_kb "$pid" $((fds_before + 2)))
		before_kb=$(result "$out" rss_before_kb)
		printf '| %s | %s | %s MiB | %s MiB | %s | %s MiB | %s MiB |\n' "${path_desc[$name]}" "$ready" \
			"$(awk -v k="$before_kb" 'BEGIN { printf "%.1f", k / 1024 }')" \
			"$(awk -v k="$(result "$out" rss_after_kb)" 'BEGIN { printf "%.1f", k / 1024 }')" \
			"$(result "$out" kib_per_conn)" \
			"$(awk -v k="$closed_kb" 'BEGIN { printf "%.1f", k / 1024 }')" \
			"$(awk -v a="$closed_kb" -v b="$before_kb" 'BEGIN { printf "%+.2f", (a - b) / 1024 }')"
	done
	[ -n "$gateway_b" ] && echo && echo "chatgate: $gateway; chatgate (B): $gateway_b"
	exit $status
fi

# ---- load: rounds x paths ----
echo "compare.sh: $conns connections, $secs s x $rounds rounds per path; fd limit $fd_limit" >&2
: >"$tmp/runs"
status=0
n_paths=${#path_names[@]}
for round in $(seq 1 "$rounds"); do
	for k in $(seq 0 $((n_paths - 1))); do
		name=${path_names[$(((k + round - 1) % n_paths))]}
		out="$tmp/run-$round-$name.out"
		pid_opt=()
		if [ -n "${path_pid[$name]}" ]; then
			pid_opt=(--pid "${path_pid[$name]}")
		fi
		case $name in
		chatgate-full*)
			pid_opt+=(--store-pid "$redis_pid")
			redis-cli -p "$redis_port" CONFIG RESETSTAT >/dev/null 2>&1
			;;
		esac
		# shellcheck disable=SC2086  # the path's options are a list
		"$bench" --url "${path_url[$name]}" --connections "$conns" --duration "$secs" --warmup 1 \
			"${pid_opt[@]}" ${path_opts[$name]} >"$out" 2>"$out.err"
		rate=$(result "$out" msgs_per_sec)
		if [ -z "$rate" ] || [ "$(result "$out" msgs)" = 0 ]; then
			echo "compare.sh: round $round $name: no result; cg_bench said:" >&2
			tail -n 5 "$out.err" >&2
			status=1
			continue
		fi
		msgs=$(result "$out" msgs)
		cpu_s=$(result "$out" gateway_cpu_s)
		cpu_1k=-
		if [ -n "${path_pid[$name]}" ] && [ -n "$cpu_s" ] && [ "${cpu_s#-}" = "$cpu_s" ]; then
			cpu_1k=$(awk -v c="$cpu_s" -v m="$msgs" 'BEGIN { printf "%.1f", c * 1e6 / m }')
		fi
		store_s=$(result "$out" store_cpu_s)
		store_turn=-
		if [ -n "$store_s" ] && [ "${store_s#-}" = "$store_s" ]; then
			store_turn=$(awk -v c="$store_s" -v m="$msgs" 'BEGIN { printf "%.1f", c * 1e6 / m }')
		fi
		# Redis's own timing of the scripts (INFO commandstats, reset before the run): µs per EVALSHA
		script_us=-
		case $name in chatgate-full*)
			script_us=$(redis-cli -p "$redis_port" INFO commandstats 2>/dev/null |
				sed -n 's/^cmdstat_evalsha:.*usec_per_call=\([0-9.]*\).*/\1/p')
			[ -n "$script_us" ] || script_us=-
			;;
		esac
		idle=$(result "$out" machine_idle_pct)
		[ -z "$idle" ] || [ "${idle#-}" != "$idle" ] && idle=-
		printf '%s %s %s %s %s %s %s %s %s %s\n' "$name" "$round" "$rate" "$(result "$out" p50_ms)" \
			"$(result "$out" p99_ms)" "$cpu_1k" "$(result "$out" errors)" "$idle" "$store_turn" "$script_us" >>"$tmp/runs"
		printf 'compare.sh: round %s %-18s %9.0f turns/s  p50 %s ms  p99 %s ms  CPU %s ms/1k turns  Redis %s µs/turn (%s µs per EVALSHA)  client CPU %s%%  CPUs idle %s%%  errors %s\n' \
			"$round" "$name" "$rate" "$(result "$out" p50_ms)" "$(result "$out" p99_ms)" "$cpu_1k" "$store_turn" "$script_us" \
			"$(result "$out" client_cpu_pct)" "$idle" "$(result "$out" errors)" >&2
		sleep 0.5 # the closing handshakes finish before the next path starts
	done
done

# reference NAME: the path NAME's ratios are to (one process per CPU against its like)
reference() {
	case $1 in
	chatgate-full-auto) echo nginx-auto ;;
	*) echo nginx ;;
	esac
}

nginx_rate=$(median 3 nginx)
direct_p50=$(median 4 direct)
echo
echo "$conns connections, $secs s x $rounds rounds, medians; cg_bench and app_backend on the same machine"
echo
echo "| path | turns/s | p50 | p99 | vs nginx | p50 over direct | proxy CPU per 1k turns | Redis CPU per turn (per EVALSHA) | CPUs idle |"
echo "|---|---|---|---|---|---|---|---|---|"
for name in "${path_names[@]}"; do
	rate=$(median 3 "$name")
	p50=$(median 4 "$name")
	p99=$(median 5 "$name")
	cpu=$(median 6 "$name")
	idle=$(median 8 "$name")
	store=$(median 9 "$name")
	script=$(median 10 "$name")
	awk -v d="${path_desc[$name]}" -v r="$rate" -v p50="$p50" -v p99="$p99" -v cpu="$cpu" -v idle="$idle" -v store="$store" -v script="$script" \
		-v nr="$(median 3 "$(reference "$name")")" -v dp="$direct_p50" -v name="$name" '
	function commas(n,   s) { s = sprintf("%d", n); while (s ~ /[0-9][0-9][0-9][0-9]/) sub(/[0-9][0-9][0-9]($|,)/, ",&", s); return s }
	BEGIN {
		if (r == "-") { printf "| %s | - | - | - | - | - | - | - | - |\n", d; exit }
		vs = (nr == "-" || nr == 0) ? "-" : sprintf("x%.2f", r / nr)
		over = (dp == "-" || name == "direct") ? "-" : sprintf("%+.3f ms", p50 - dp)
		c = (cpu == "-") ? "-" : sprintf("%.0f ms", cpu)
		i = (idle == "-") ? "-" : sprintf("%.0f%%", idle)
		st = (store == "-") ? "-" : sprintf("%.1f µs", store)
		if (st != "-" && script != "-") st = st sprintf(" (%.1f µs)", script)
		printf "| %s | %s | %.3f ms | %.3f ms | %s | %s | %s | %s | %s |\n", d, commas(r + 0.5), p50, p99, vs, over, c, st, i
	}'
done
# Each path against the nginx run of its own round: nginx moves by a tenth or more within
# one run on a shared machine, and a path's run sits closest in time to its own round's.
if [ "$nginx_rate" != "-" ] || [ "$(median 3 nginx-auto)" != "-" ]; then
	echo
	echo "| path | vs the same round's nginx: lowest | median | highest |"
	echo "|---|---|---|---|"
	for name in "${path_names[@]}"; do
		[ "$name" = nginx ] && continue
		read -r lo mid hi < <(awk -v n="$name" -v ref="$(reference "$name")" \
			'$1 == ref { ng[$2] = $3 } $1 == n { r[$2] = $3 }
			END { for (k in r) if (ng[k] > 0) print r[k] / ng[k] }' "$tmp/runs" | spread)
		if [ "$lo" = - ]; then
			echo "| ${path_desc[$name]} | - | - | - |"
		else
			awk -v d="${path_desc[$name]}" -v a="$lo" -v b="$mid" -v c="$hi" \
				'BEGIN { printf "| %s | x%.2f | x%.2f | x%.2f |\n", d, a, b, c }'
		fi
	done
fi
echo
[ -n "$gateway_b" ] && echo "chatgate: $gateway; chatgate (B): $gateway_b"
echo "(proxy CPU per 1k turns: user + system time of the proxy process, with its workers', over the window, per 1,000 turns; ms per 1k turns = µs per turn)"
echo "(Redis CPU per turn: user + system time of the redis-server over the window, per turn; per EVALSHA: Redis's own timing of a script, usec_per_call of INFO commandstats, reset before each run; the paths with Redis share one redis-server and run one at a time)"
echo "(CPUs idle: the share of every CPU's time over the window that was idle, from /proc/stat; a path that leaves CPUs idle while every connection has a turn in flight is waiting on one of its processes, not on the cores)"
wants chatgate-full-auto && echo "(chatgate with --workers auto is compared with nginx with worker_processes auto, in both tables)"
exit $status
