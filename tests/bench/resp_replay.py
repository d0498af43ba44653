#!/usr/bin/env python3
"""Replays the commands a gateway sent, from a MONITOR recording, into a Redis server.

    tests/bench/resp_replay.py MONITOR_FILE PORT

MONITOR_FILE is what `redis-cli monitor` printed while a gateway ran: one line per command,
its arguments quoted with C-like escapes. The commands the gateway's connections sent (not
those a script ran, which MONITOR shows as the "lua" client's; not the connection's own
housekeeping: PING, INFO, AUTH, SELECT, CLIENT, HELLO, the bus's subscriptions) are parsed
back into RESP and sent to 127.0.0.1:PORT, pipelined in batches of 50 (each batch ends with
a PING, and the batch's answers are read up to its PONG), in the order recorded.
The server should be a fresh one: the scripts take leases and compare revs, so a replay
only does the same work when it starts from the same (empty) data. Used by
script_cost.sh, which reads the server's INFO commandstats afterwards (docs/state.md,
"What the scripts cost Redis").

Prints the number of commands sent and of error answers. Exit status 0, or 1 when the file
held no command of a gateway or the server could not be reached.
"""
import socket
import sys

ESCAPES = {"n": b"\n", "r": b"\r", "t": b"\t", "a": b"\a", "b": b"\b", "\\": b"\\", '"': b'"'}


# a connection's housekeeping, and commands that would change what the replay's connection is
SKIPPED = {b"PING", b"INFO", b"AUTH", b"SELECT", b"CLIENT", b"HELLO", b"QUIT", b"READONLY", b"MONITOR",
           b"SUBSCRIBE", b"PSUBSCRIBE", b"SSUBSCRIBE", b"UNSUBSCRIBE", b"PUNSUBSCRIBE"}


def sent(line):
    """Is this MONITOR line a command a gateway's connection sent (not a script's call)?"""
    start = line.find(" [")
    end = line.find("] ", start)
    return start >= 0 and end > start and not line[start:end].endswith(" lua")


def parse(line):
    """The arguments of one MONITOR line ('<time> [<db> <client>] "arg" "arg" ...'), as bytes."""
    text = line[line.index("] ") + 2:].rstrip("\n")
    args, i = [], 0
    while i < len(text):
        if text[i] != '"':
            i += 1
            continue
        i += 1
        arg = bytearray()
        while text[i] != '"':
            c = text[i]
            if c == "\\":
                n = text[i + 1]
                if n == "x":
                    arg.append(int(text[i + 2:i + 4], 16))
                    i += 4
                    continue
                arg += ESCAPES[n]
                i += 2
                continue
            arg += c.encode()
            i += 1
        args.append(bytes(arg))
        i += 1
    return args


def resp(args):
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


def main():
    if len(sys.argv) != 3:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    with open(sys.argv[1], encoding="utf-8", errors="replace") as f:
        commands = [c for c in (parse(line) for line in f if sent(line)) if c and c[0].upper() not in SKIPPED]
    if not commands:
        print(f"resp_replay: no command of a gateway in {sys.argv[1]}", file=sys.stderr)
        return 1
    try:
        sock = socket.create_connection(("127.0.0.1", int(sys.argv[2])), timeout=30)
    except OSError as err:
        print(f"resp_replay: 127.0.0.1:{sys.argv[2]}: {err}", file=sys.stderr)
        return 1
    errors = 0
    for k in range(0, len(commands), 50):
        sock.sendall(b"".join(resp(c) for c in commands[k:k + 50]) + resp([b"PING"]))
        got = b""
        while not got.endswith(b"+PONG\r\n"):
            chunk = sock.recv(1 << 20)
            if not chunk:
                print("resp_replay: the server closed the connection", file=sys.stderr)
                return 1
            got += chunk
        errors += got.count(b"\r\n-") + got.startswith(b"-")
    print(f"resp_replay: {len(commands)} commands sent, {errors} error answers")
    return 0


if __name__ == "__main__":
    sys.exit(main())
