# shellcheck shell=bash
# tests/bench/ports.sh: sourced by the bench scripts (run.sh, compare.sh, scaleout.sh).
# port_is_open PORT: something accepts on 127.0.0.1:PORT.
# pick_free_port: prints a port nothing listens on (20000-59999); 1 when 50 tries found none.

port_is_open() {
	(exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

pick_free_port() {
	local port
	for _ in $(seq 1 50); do
		port=$((20000 + RANDOM % 40000))
		if ! port_is_open "$port"; then
			echo "$port"
			return 0
		fi
	done
	return 1
}
