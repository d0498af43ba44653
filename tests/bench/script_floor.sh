#!/usr/bin/env bash
# What the parts of a Lua script cost Redis, in instructions (valgrind's callgrind), so that
# a layout of the dialog in Redis can be weighed before it is written (docs/state.md, "What
# the scripts cost Redis"):
#
#   tests/bench/script_floor.sh
#
# Starts a redis-server under callgrind on a free port and sends it, for each case below,
# 10,000 EVALSHA pipelined 50 at a time (after 1,000 not counted), and prints the server's
# instructions per EVALSHA: what doing nothing costs with one key, with 10 and 20 arguments
# of one byte, with 10 of 45 bytes (a key's length), with a save's arguments (7 keys, 28
# arguments and two history messages), and one call of GET, EXISTS, DEL, SET and SET ... PX.
# Then three ways a save could be cheaper: its 19 numbers packed into one argument that
# string.match takes apart; its keys made in Lua from one base key given (Redis's rule is
# that a script is given every key it touches, so chatgate does not do this); and the
# dialog as one value (a hash of its rev and its JSON, 1.4 KB here: 10 history messages),
# saved with 5 calls on 3 keys (the lock, GET then SET back so that every call finds it:
# a DEL, as a real save lets go, costs about 5,500 less).
# The difference between two lines is what the part costs; the figures are the same on
# every run (they are instructions, not time). Needs redis-server, redis-cli,
# redis-benchmark (Debian's redis-server and redis-tools) and valgrind.
set -u
. "$(dirname "$0")/ports.sh"

for tool in redis-server redis-cli redis-benchmark valgrind callgrind_control; do
	command -v $tool >/dev/null || { echo "$0: $tool is needed (apt-get install redis-server redis-tools valgrind)" >&2; exit 1; }
done
bench_workdir script_floor

port=$(pick_free_port) || exit 1
callgrind_redis "$port" || exit 1
redis=$started_pid

# one case: LABEL SCRIPT NUMKEYS [KEYS AND ARGUMENTS...]
measure() {
	local label=$1 script=$2 sha
	shift 2
	sha=$(redis-cli -p "$port" script load "$script")
	redis-benchmark -p "$port" -c 1 -P 50 -n 1000 -q evalsha "$sha" "$@" >/dev/null 2>&1
	callgrind_control -z "$redis" >/dev/null 2>&1
	redis-benchmark -p "$port" -c 1 -P 50 -n 10000 -q evalsha "$sha" "$@" >/dev/null 2>&1
	if ! callgrind_count "$redis"; then
		echo "$0: no count for: $label" >&2
		return 1
	fi
	printf '%7d  %s\n' $((callgrind_total / 10000)) "$label"
}

u='chatgate:{u_deca945840b10a33}'
key="$u:bench:params"
keys7="$u:bench:params $u:bench:dialog $u:bench:awaiting $u:bench:soft $u:bench:history $u:bench:lock $u:rooms"
args28='1795882308 1795882311 0 21600 21600 1800 14717 14718 travel 1 null 0 0 -1 gw:1:c78e2085#32079 14718
bench 21600 {"app":{"in":1721574,"out":147170,"turns":14717}} gw:1:c78e2085#32080 gw:1:c78e2085#32079 10 10 0 1 0
1795882311030'
short10='a b c d e f g h i j'
long10=$(for k in 0 1 2 3 4 5 6 7 8 9; do printf '%s:bench:param%s ' "$u" "$k"; done)
msg1='{"role":"user","content":"Find flights from Nairobi to London on Feb 10","ts":1795882311}'
msg2='{"role":"assistant","content":"Here are some flights","ts":1795882311}'

# the save's 19 numbers in one argument, and its 9 other arguments
packed='1795882308 1795882311 0 21600 21600 1800 14717 14718 1 0 0 -1 21600 10 10 0 1 0 1795882311030'
strs='travel null gw:1:c78e2085#32079 bench {"app":{"in":1721574,"out":147170,"turns":14717}} gw:1:c78e2085#32080 gw:1:c78e2085#32079'
unpack19="local a,b,c,d,e,f,g,h,i,j,k,l,m,n,o,p,q,r,s = string.match(ARGV[1], '^(%d+) (%d+) (%d) (%d+) (%d+) (%d+) (%d+) (%d+) (%d) (%d+) (%d+) (%-?%d+) (%d+) (%d+) (%d+) (%d) (%d) (%d+) (%d+)$') return 1"
derive="local b = KEYS[1] local k1, k2, k3, k4, k5, k6 = b .. 'params', b .. 'dialog', b .. 'awaiting', b .. 'soft', b .. 'history', b .. 'lock' return 1"
# a dialog as one value: its JSON with the history's 10 messages
history=''
for k in 1 2 3 4 5; do
	history="$history${history:+,}{\"role\":\"user\",\"content\":\"Find flights from Nairobi to London on Feb 10\",\"ts\":1795882311,\"rules\":[\"flight_route\",\"departure_date\"]}"
	history="$history,{\"role\":\"assistant\",\"content\":\"Here are some flights\",\"ts\":1795882311,\"upstream\":\"app\"}"
done
one_value="{\"service\":\"travel\",\"params\":{\"travel\":{\"from\":\"Nairobi\",\"to\":\"London\",\"departure_date\":\"2026-02-10\"}},\"meta\":{\"created_at\":1795882308,\"last_activity\":1795882311,\"turn_count\":14717,\"message_count\":14718},\"usage\":{\"app\":{\"in\":1721574,\"out\":147170,\"turns\":14717}},\"history\":[$history],\"expires\":{\"params\":1795903911,\"history\":1795884111}}"
one_save="local cur = redis.call('GET', KEYS[2])
if cur and cur ~= ARGV[1] then return -2 end
if (redis.call('HGET', KEYS[1], 'rev') or '') ~= ARGV[2] then return -3 end
redis.call('HSET', KEYS[1], 'rev', ARGV[2], 'v', ARGV[3])
redis.call('ZADD', KEYS[3], ARGV[4], ARGV[5])
redis.call('SET', KEYS[2], ARGV[1])
return 1"

echo "instructions a script (EVALSHA), redis-server $(redis-server --version | sed -n 's/.*v=\([^ ]*\).*/\1/p') under callgrind:"
status=0
# shellcheck disable=SC2086 # the lists are meant to split into arguments
{
	measure "return 1; 1 key" "return 1" 1 "$key"
	measure "return 1; 1 key and 10 arguments of 1 byte" "return 1" 1 "$key" $short10
	measure "return 1; 1 key and 20 arguments of 1 byte" "return 1" 1 "$key" $short10 $short10
	measure "return 1; 1 key and 10 arguments of 45 bytes" "return 1" 1 "$key" $long10
	measure "return 1; a save's 7 keys, 28 arguments and 2 messages" "return 1" 7 $keys7 $args28 "$msg1" "$msg2"
	measure "GET; 1 key" "return redis.call('GET', KEYS[1])" 1 "$key"
	measure "EXISTS; 1 key" "return redis.call('EXISTS', KEYS[1])" 1 "$key"
	measure "DEL; 1 key" "return redis.call('DEL', KEYS[1])" 1 "$key"
	measure "SET; 1 key, 1 argument" "return redis.call('SET', KEYS[1], ARGV[1])" 1 "$key" "gw:1:aa#1"
	measure "SET PX; 1 key, 2 arguments" "return redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])" 1 "$key" "gw:1:aa#1" 15000
	measure "return 1; a save's 7 keys, its 19 numbers in one argument (string.match), 9 arguments, 2 messages" \
		"$unpack19" 7 $keys7 "$packed" $strs "$msg1" "$msg2"
	measure "return 1; a save's 28 arguments and 2 messages, its 6 dialog keys made from 1 given" \
		"$derive" 2 "$u:bench:" "$u:rooms" $args28 "$msg1" "$msg2"
	redis-cli -p "$port" hset "$u:bench:one" rev "gw:1:c78e2085#32080" >/dev/null
	measure "a save of the dialog as one value (${#one_value} bytes): 3 keys, 5 arguments; GET, HGET, HSET, ZADD, SET" \
		"$one_save" 3 "$u:bench:one" "$u:bench:lock1" "$u:rooms1" "gw:1:c78e2085#9" "gw:1:c78e2085#32080" \
		"$one_value" 1795882311030 bench
} || status=1
redis-cli -p "$port" shutdown nosave >/dev/null 2>&1
exit $status
