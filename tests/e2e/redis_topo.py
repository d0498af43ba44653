"""Real Redis topologies for the end-to-end tests of the Redis store over TLS and against
Redis Cluster (test_redis_tls.py, test_redis_cluster.py).

Everything runs from Debian 12's packages: redis-server 7.0 (built with TLS), redis-cli and the
openssl command, on free ports, each process in a temp dir of its own (harness.temp_dir: kept
when a test fails, removed when it passes). The servers are harness.RedisServer subclasses, so
harness.run kills them at the end like any other, and their tiny inspection client
(`command()`, `keys()`...) works as before.

- `CertFactory(dir)`: a test CA, an unrelated "wrong" CA, and certificates made with the
  openssl CLI: a good server certificate (localhost, 127.0.0.1), one for the wrong name, an
  expired one, a client certificate for mutual TLS (and one from the wrong CA).
- `TLSRedisServer(certs, ...)`: redis-server with a TLS port (what the gateway uses) and a
  plain port beside it (what the inspection client uses); picks which server certificate it
  shows and whether it asks clients for theirs.
- `acl_user(redis, user, password)`: an ACL user allowed everything.
- `RedisCluster(n_masters, replicas_per_master, tls=None)`: `redis-cli --cluster create` over
  fresh nodes, then the moves a test makes: kill a master and wait for the failover, reshard
  slots in the background while traffic goes on.
- `TLSSentinel(primary, certs)`: test_sentinel.py's Sentinel over TLS; `sentinel_url()`.
- `with_auth(url, user, password)`: a URL of these with an ACL user's credentials.
- `redis_cli(...)`: Debian's redis-cli with the TLS and auth flags these servers need.

Run this file to check the machinery itself: `python3 redis_topo.py` (about 15 s).
"""

import asyncio
import socket
import ssl
import subprocess
import time
from pathlib import Path

import harness
from harness import check, fail, step

REDIS_CLI = "/usr/bin/redis-cli"
OPENSSL = "/usr/bin/openssl"
CLUSTER_SLOTS = 16384
SENTINEL_MASTER = "mymaster"

_ports_given = set()  # ports this module handed out, so that two servers never get one


def unique_port():
    """harness.free_port, but never one this module gave out before: a cluster takes up to
    three ports per node at once, and the kernel may hand the same free port out twice
    before anything listens on it."""
    while True:
        port = harness.free_port()
        if port not in _ports_given:
            _ports_given.add(port)
            return port


def _errors():
    """What an inspection command raises while a server starts, stops or changes roles."""
    return (OSError, ConnectionError, harness.RedisError)


def wait_for(what, predicate, timeout, state=None):
    """Poll `predicate` every 50 ms until it returns something true (returned); fail after
    `timeout` seconds naming `what` and, if given, `state()` (what was seen last). A predicate
    that raises a connection or Redis error counts as false: nodes come and go meanwhile."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
        except _errors():
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            seen = ""
            if state is not None:
                try:
                    seen = f"; last seen: {state()}"
                except _errors() as err:
                    seen = f"; last seen: {err}"
            fail(f"{what}: not within {timeout:.0f} s{seen}")
        time.sleep(0.05)


# --------------------------------------------------------------------------------------
# Certificates


class CertFactory:
    """Test certificates made by the openssl CLI in `directory` (a new temp dir if None),
    all at construction (EC P-256 keys: about 0.1 s in all). PEM file paths (str):

    - `ca` (`ca_key`): the test CA that signs everything below but the wrong_client pair.
    - `wrong_ca` (`wrong_ca_key`): an unrelated CA; a client trusting only it refuses every
      server certificate here.
    - `server_cert`/`server_key`: CN localhost, SAN DNS:localhost and IP:127.0.0.1, for
      serverAuth and clientAuth (Redis nodes show it as their client certificate to each other
      on the cluster bus and for replication).
    - `wrong_name_cert`/`wrong_name_key`: signed by the CA, SAN DNS:wrong.example only.
    - `expired_cert`/`expired_key`: SAN localhost and 127.0.0.1, valid from two days ago to
      one hour ago (`openssl ca -startdate -enddate`: OpenSSL 3.0's `x509 -req -days -1`
      makes a certificate whose notAfter precedes its notBefore, not a plainly expired one).
    - `client_cert`/`client_key`: CN "chatgate test client", clientAuth, for mutual TLS.
    - `wrong_client_cert`/`wrong_client_key`: the same, signed by the wrong CA.
    """

    def __init__(self, directory=None, days=2):
        self.dir = Path(directory) if directory else harness.temp_dir("chatgate-e2e-certs-")
        self.dir.mkdir(parents=True, exist_ok=True)
        self.days = days
        self.ca, self.ca_key = self._make_ca("ca", "chatgate test CA")
        self.wrong_ca, self.wrong_ca_key = self._make_ca("wrong-ca", "chatgate unrelated CA")
        server_names = "DNS:localhost,IP:127.0.0.1"
        self.server_cert, self.server_key = self._make_leaf("server", "localhost", server_names)
        self.wrong_name_cert, self.wrong_name_key = self._make_leaf(
            "wrong-name", "wrong.example", "DNS:wrong.example")
        now = time.time()
        self.expired_cert, self.expired_key = self._make_leaf(
            "expired", "localhost", server_names, valid=(now - 2 * 86400, now - 3600))
        self.client_cert, self.client_key = self._make_leaf(
            "client", "chatgate test client", None, usage="clientAuth")
        self.wrong_client_cert, self.wrong_client_key = self._make_leaf(
            "wrong-client", "chatgate test client", None, usage="clientAuth", ca="wrong-ca")

    def server_pair(self, which="good"):
        """(cert, key) of the server certificate named `which`: good, wrong_name or expired."""
        pairs = {"good": (self.server_cert, self.server_key),
                 "wrong_name": (self.wrong_name_cert, self.wrong_name_key),
                 "expired": (self.expired_cert, self.expired_key)}
        check(which in pairs, f"no server certificate '{which}' (one of {', '.join(pairs)})")
        return pairs[which]

    def openssl(self, *args, cwd=None):
        """Run `openssl ARGS` in the certificate directory; fail with its output if it fails."""
        proc = subprocess.run([OPENSSL, *args], cwd=cwd or self.dir, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            fail(f"openssl {' '.join(args)} (in {cwd or self.dir}) exited {proc.returncode}:\n"
                 f"{proc.stdout[-1000:]}{proc.stderr[-1000:]}")
        return proc.stdout

    def _make_ca(self, name, cn):
        # A config of our own, not the system's openssl.cnf: the CA extensions and the
        # `openssl ca` database (which is what lets a certificate carry chosen dates).
        db = self.dir / f"{name}.db"
        db.mkdir()
        (db / "index.txt").write_text("")
        (db / "serial").write_text("01\n")
        (self.dir / f"{name}.cnf").write_text(
            "[ req ]\ndistinguished_name = dn\nprompt = no\n[ dn ]\n"
            "[ ca ]\ndefault_ca = test_ca\n"
            f"[ test_ca ]\ndatabase = {db}/index.txt\nnew_certs_dir = {db}\nserial = {db}/serial\n"
            "default_md = sha256\npolicy = any_name\nunique_subject = no\ncopy_extensions = none\n"
            "[ any_name ]\ncommonName = supplied\n"
            "[ v3_ca ]\nbasicConstraints = critical, CA:TRUE\nkeyUsage = critical, keyCertSign, cRLSign\n"
            "subjectKeyIdentifier = hash\n")
        self.openssl("req", "-config", f"{name}.cnf", "-x509", *self._new_key(f"{name}.key"),
                     "-out", f"{name}.pem", "-days", str(self.days), "-subj", f"/CN={cn}",
                     "-extensions", "v3_ca")
        return str(self.dir / f"{name}.pem"), str(self.dir / f"{name}.key")

    @staticmethod
    def _new_key(path):
        return ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", path]

    def _make_leaf(self, name, cn, names, usage="serverAuth, clientAuth", valid=None, ca="ca"):
        """A key and a certificate signed by CA `ca`, for subjectAltName `names` (None: none),
        valid for self.days from now or over `valid` = (start, end) in seconds since the epoch."""
        ext = ["[ leaf ]", "basicConstraints = critical, CA:FALSE", f"extendedKeyUsage = {usage}",
               "authorityKeyIdentifier = keyid"]
        if names:
            ext.append(f"subjectAltName = {names}")
        (self.dir / f"{name}.ext").write_text("\n".join(ext) + "\n")
        self.openssl("req", "-config", f"{ca}.cnf", "-new", *self._new_key(f"{name}.key"),
                     "-out", f"{name}.csr", "-subj", f"/CN={cn}")
        if valid:
            fmt = "%Y%m%d%H%M%SZ"
            dates = ["-startdate", time.strftime(fmt, time.gmtime(valid[0])),
                     "-enddate", time.strftime(fmt, time.gmtime(valid[1]))]
        else:
            dates = ["-days", str(self.days)]
        self.openssl("ca", "-batch", "-config", f"{ca}.cnf", "-cert", f"{ca}.pem", "-keyfile", f"{ca}.key",
                     "-in", f"{name}.csr", "-out", f"{name}.pem", "-notext", *dates,
                     "-extfile", f"{name}.ext", "-extensions", "leaf")
        return str(self.dir / f"{name}.pem"), str(self.dir / f"{name}.key")


def tls_probe(port, ca, hostname="localhost", cert=None, key=None, timeout=3.0):
    """A TLS handshake with 127.0.0.1:`port` as a client trusting `ca` and checking
    `hostname` (None: no name check), with a client certificate if given; then PING. None
    when the server answered (PONG, or -NOAUTH when it wants a password: TLS was accepted),
    else what failed (the verify message, or the server's refusal)."""
    ctx = ssl.create_default_context(cafile=ca)
    ctx.check_hostname = hostname is not None
    if cert:
        ctx.load_cert_chain(cert, key)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as raw:
            with ctx.wrap_socket(raw, server_hostname=hostname) as tls:
                # TLS 1.3: a server refuses a client certificate after the handshake, so only
                # a reply proves that it took the connection.
                tls.sendall(b"*1\r\n$4\r\nPING\r\n")
                reply = tls.recv(64)
                return None if reply.startswith((b"+PONG", b"-NOAUTH")) else f"answered {reply!r}"
    except ssl.SSLCertVerificationError as err:
        return f"verify: {err.verify_message}"
    except (ssl.SSLError, OSError) as err:
        return f"{type(err).__name__}: {err}"


# --------------------------------------------------------------------------------------
# redis-cli


def redis_cli_argv(port, tls=None, client_cert=False, user=None, password=None, cluster=False,
                   ca=None):
    """The start of a redis-cli command line for 127.0.0.1:`port`: `tls` (a CertFactory)
    adds --tls --cacert (`ca`, default the factory's CA) and, with `client_cert`, the client
    certificate; `password` (and `user`) add -a/--user; `cluster` adds -c."""
    argv = [REDIS_CLI, "-h", "127.0.0.1", "-p", str(port)]
    if tls is not None:
        argv += ["--tls", "--cacert", ca or tls.ca]
        if client_cert:
            argv += ["--cert", tls.client_cert, "--key", tls.client_key]
    if password is not None:
        argv += ["--no-auth-warning", "-a", password]
        if user is not None:
            argv += ["--user", user]
    if cluster:
        argv.append("-c")
    return argv


def redis_cli(port, *args, stdin=None, timeout=30, **options):
    """Run redis-cli on 127.0.0.1:`port` with `args` (a command, or --cluster ...) and the
    `options` of redis_cli_argv; `stdin`: text of commands, one a line. The CompletedProcess
    (stdout and stderr as text); the caller judges it (redis-cli often exits 0 on an error
    reply)."""
    argv = redis_cli_argv(port, **options) + [str(a) for a in args]
    try:
        return subprocess.run(argv, input=stdin, stdin=None if stdin is not None else subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        fail(f"{' '.join(argv)} ran for {timeout} s")


def replies(proc):
    """The replies redis-cli printed, one a line, without the "-> Redirected to slot ..."
    notices that -c prints on stdout when it follows a MOVED."""
    return [line for line in proc.stdout.splitlines() if not line.startswith("-> Redirected")]


# --------------------------------------------------------------------------------------
# TLS servers and ACL users


def tls_server_args(certs, tls_port, cert="good", auth_clients="no"):
    """redis-server options for a TLS port showing server certificate `cert` (good,
    wrong_name or expired), trusting certs.ca for the client certificates asked for when
    `auth_clients` is yes (Redis's default is yes: a client without one is refused), and
    using TLS for its own replication (and Sentinel's) connections."""
    check(auth_clients in ("no", "yes", "optional"), f"tls-auth-clients {auth_clients}?")
    cert_file, key_file = certs.server_pair(cert)
    return ["--tls-port", str(tls_port), "--tls-cert-file", cert_file, "--tls-key-file", key_file,
            "--tls-ca-cert-file", certs.ca, "--tls-auth-clients", auth_clients,
            "--tls-replication", "yes"]


# A master syncing a replica waits repl-diskless-sync-delay (5 s) for more replicas to come
# first: 5 s more to start any topology with replicas.
NO_SYNC_DELAY = ["--repl-diskless-sync-delay", "0"]


class TLSRedisServer(harness.RedisServer):
    """A redis-server whose clients connect over TLS on `tls_port` (`url`: rediss://), with
    a plain port beside it (`port`, `plain_url`) that only the test's inspection client uses:
    harness.RedisServer's `command()`, start-up PING and the rest work unchanged.

    `cert`: which server certificate of `certs` it shows (good, wrong_name, expired);
    `tls_auth_clients`: no, or yes for mutual TLS (a client certificate signed by certs.ca);
    `password`: --requirepass, as for RedisServer; `replica_of`: a TLSRedisServer to replicate
    from, over TLS (`masterauth` its password)."""

    def __init__(self, certs, cert="good", tls_auth_clients="no", password=None, replica_of=None):
        super().__init__(port=unique_port(), password=password)
        self.certs = certs
        self.cert = cert
        self.tls_auth_clients = tls_auth_clients
        self.tls_port = unique_port()
        self.replica_of = replica_of
        certs.server_pair(cert)  # fails now on a bad name, not at start

    @property
    def plain_url(self):
        return super().url

    @property
    def url(self):
        auth = f":{self.password}@" if self.password else ""
        return f"rediss://{auth}127.0.0.1:{self.tls_port}"

    def command_line(self):
        cmd = super().command_line() + NO_SYNC_DELAY + tls_server_args(
            self.certs, self.tls_port, self.cert, self.tls_auth_clients)
        if self.replica_of is not None:
            cmd += ["--replicaof", "127.0.0.1", str(self.replica_of.tls_port)]
            if self.replica_of.password:
                cmd += ["--masterauth", self.replica_of.password]
        return cmd

    def cli(self, *args, client_cert=None, ca=None, **options):
        """redis-cli over TLS on tls_port (client certificate when the server asks for one)."""
        if client_cert is None:
            client_cert = self.tls_auth_clients == "yes"
        options.setdefault("password", self.password)
        return redis_cli(self.tls_port, *args, tls=self.certs, client_cert=client_cert, ca=ca, **options)


def with_auth(url, user, password):
    """`url` (any redis*:// URL of this module) with credentials user:password@ instead of
    its own (user None: :password@, the default user's form)."""
    scheme, _, rest = url.partition("://")
    rest = rest.rpartition("@")[2] if "@" in rest.split("/", 1)[0] else rest
    return f"{scheme}://{user or ''}:{password}@{rest}"


def acl_user(redis, user, password, rules=("~*", "&*", "+@all")):
    """`ACL SETUSER user reset on >password ~* &* +@all` (or other `rules`) on a running
    server (anything with command(): RedisServer, a cluster node); `reset` first, so that
    calling it again redefines the user instead of adding a second password. For the default
    user's password, start the server with password= (--requirepass) instead."""
    reply = redis.command("ACL", "SETUSER", user, "reset", "on", f">{password}", *rules)
    check(reply == "OK", f"ACL SETUSER {user} on redis port {redis.port}: {reply!r}")
    return reply


# --------------------------------------------------------------------------------------
# Redis Cluster


class ClusterNode(harness.RedisServer):
    """One redis-server of a RedisCluster: `port` is its plain port (the inspection client's,
    and the clients' without TLS), `tls_port` its TLS port (None without TLS), `client_port`
    the one clients use, `bus_port` its cluster bus port, `node_id` its cluster node id (known
    once started). Over TLS the cluster bus and replication are TLS too (--tls-cluster,
    --tls-replication) and the plain port stays open for inspection: Redis 7 tells a plain
    connection the nodes' plain ports (CLUSTER NODES, MOVED) and a TLS one their TLS ports."""

    def __init__(self, tls=None, tls_auth_clients="no", password=None, node_timeout_ms=1000,
                 extra_args=()):
        super().__init__(port=unique_port(), password=password)
        self.tls = tls
        self.tls_auth_clients = tls_auth_clients
        self.tls_port = unique_port() if tls else None
        # An explicit bus port: the default, port + 10000, is past 65535 for a free port
        # above 55535, and nobody checked that it is free.
        self.bus_port = unique_port()
        self.node_timeout_ms = node_timeout_ms
        self.extra_args = list(extra_args)
        self.node_id = None

    @property
    def client_port(self):
        return self.tls_port or self.port

    @property
    def address(self):
        return f"127.0.0.1:{self.client_port}"

    def command_line(self):
        cmd = super().command_line() + [
            "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
            "--cluster-port", str(self.bus_port),
            "--cluster-node-timeout", str(self.node_timeout_ms),
            # A replica may always take over, however long ago it last heard from its master:
            # a test's failover must not depend on the replica's link age.
            "--cluster-replica-validity-factor", "0", *NO_SYNC_DELAY]
        if self.password:
            cmd += ["--masterauth", self.password]
        if self.tls:
            cmd += tls_server_args(self.tls, self.tls_port, "good", self.tls_auth_clients)
            cmd += ["--tls-cluster", "yes"]
        return cmd + self.extra_args

    def start(self, timeout=10.0):
        super().start(timeout)
        self.node_id = self.command("CLUSTER", "MYID")
        return self

    def cluster_info(self):
        """CLUSTER INFO as a dict of strings."""
        return dict(line.split(":", 1) for line in self.command("CLUSTER", "INFO", timeout=1.0).splitlines()
                    if ":" in line)

    def cluster_nodes(self):
        """CLUSTER NODES as this node sees it: [{id, port, flags (set), master (id or None),
        link, slots [(first, last), ...]}]. Slots being migrated ([n->-id], [n-<-id]) are not
        listed: they belong to the node listing them without brackets."""
        out = []
        for line in self.command("CLUSTER", "NODES", timeout=1.0).splitlines():
            f = line.split()
            if len(f) < 8:
                continue
            addr = f[1].split("@")[0]
            slots = []
            for s in f[8:]:
                if s.startswith("["):
                    continue
                first, _, last = s.partition("-")
                slots.append((int(first), int(last or first)))
            out.append({"id": f[0], "port": int(addr.rsplit(":", 1)[1] or 0), "flags": set(f[2].split(",")),
                        "master": None if f[3] == "-" else f[3], "link": f[7], "slots": slots})
        return out

    def role(self):
        return self.command("ROLE", timeout=1.0)[0]


class ReshardRun:
    """`redis-cli --cluster reshard` running in the background: `running()`, `join(timeout)`
    or `await ajoin(timeout)` (waits, fails on a non-zero exit or "[ERR]" in its output,
    returns the output; `elapsed` is then its run time), `kill()`. Its output goes to
    `log_path`."""

    def __init__(self, argv, log_path, what):
        self.argv = argv
        self.log_path = log_path
        self.what = what
        self.started = time.monotonic()
        self.elapsed = None
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)

    def running(self):
        return self.proc.poll() is None

    def output(self):
        return Path(self.log_path).read_text(errors="replace")

    def join(self, timeout=60):
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            fail(f"{self.what} ran for more than {timeout} s (log {self.log_path}):\n{self.output()[-2000:]}")
        if self.elapsed is None:
            self.elapsed = time.monotonic() - self.started
        out = self.output()
        check(code == 0 and "[ERR]" not in out,
              f"{self.what} exited {code} (log {self.log_path}):\n{out[-2000:]}")
        return out

    async def ajoin(self, timeout=60):
        return await asyncio.to_thread(self.join, timeout)

    def kill(self):
        if self.running():
            self.proc.kill()
            self.proc.wait()


class RedisCluster:
    """A Redis Cluster of `n_masters` masters with `replicas_per_master` replicas each, made by
    `redis-cli --cluster create` over fresh ClusterNodes (1 s node timeout, so a failover takes
    seconds). `tls`: a CertFactory to run it all over TLS (clients, bus, replication);
    `tls_auth_clients`: yes to ask clients for certificates; `password`: requirepass (and
    masterauth) on every node.

    `start()` / `astart()` (or `async with`) create it and wait until every node says
    cluster_state:ok with all 16384 slots assigned, knows every other node, and every replica's
    link is up. `nodes` lists the ClusterNodes; `seeds_url()` is the URL for the gateway;
    `cli(...)` runs redis-cli with the cluster's TLS and password; `acl_user(user, password)`
    defines a user on every node. Then, always read live from the nodes: `masters()`,
    `replicas()`, `replicas_of(master)`, `slots_of(node)`, `master_of_slot(slot)`,
    `key_slot(key)`, `live()`, `node(port or id)`. Moves: `kill_master(node)` (SIGKILL) and
    `wait_failover(old, timeout)` / `await_failover`; `reshard(from, to, slots)` (background
    redis-cli, a ReshardRun to join); `wait_stable()` / `await_stable`; `stop()`. Each node
    also has the RedisServer moves (kill, pause, resume, restart: it rejoins from its
    nodes.conf, as a replica if it lost its slots) and inspection client. Methods taking a
    node take a ClusterNode, its plain or TLS port, or its node id. `timings` holds the
    seconds of the last create and failover (a ReshardRun has its own `elapsed`)."""

    def __init__(self, n_masters=3, replicas_per_master=1, tls=None, tls_auth_clients="no",
                 password=None, node_timeout_ms=1000, extra_args=()):
        check(n_masters >= 3, "Redis Cluster needs at least 3 masters")
        self.n_masters = n_masters
        self.replicas_per_master = replicas_per_master
        self.tls = tls
        self.tls_auth_clients = tls_auth_clients
        self.password = password
        self.dir = harness.temp_dir("chatgate-e2e-cluster-")
        self.nodes = [ClusterNode(tls, tls_auth_clients, password, node_timeout_ms, extra_args)
                      for _ in range(n_masters * (1 + replicas_per_master))]
        self.background = []  # ReshardRun
        self.timings = {}  # what -> seconds of the last one (create, failover)
        self.orphans = {}  # node id of a killed master -> its replicas then, for wait_failover
        self._killed_at = {}  # node id of a killed master -> time.monotonic() of the kill

    # -- addresses
    def seeds_url(self, scheme=None, n=3, auth=True):
        """scheme://[:password@]127.0.0.1:P1,127.0.0.1:P2,... of the first `n` nodes' client
        ports (the TLS ports over TLS); `scheme` by default redis-cluster, rediss-cluster over
        TLS (the gateway's two). with_auth() puts an ACL user in it."""
        scheme = scheme or ("rediss-cluster" if self.tls else "redis-cluster")
        cred = f":{self.password}@" if auth and self.password else ""
        return f"{scheme}://{cred}" + ",".join(n.address for n in self.nodes[:n])

    def cli(self, *args, node=None, **options):
        """redis-cli with this cluster's TLS and password on `node` (default: a live one)."""
        target = self.node(node) if node is not None else self.live()[0]
        options.setdefault("tls", self.tls)
        options.setdefault("client_cert", self.tls_auth_clients == "yes")
        options.setdefault("password", self.password)
        return redis_cli(target.client_port, *args, **options)

    # -- start and stop
    def start(self, timeout=30.0):
        started = time.monotonic()
        for n in self.nodes:
            n.start()
        proc = self.cli("--cluster", "create", *[n.address for n in self.nodes],
                        "--cluster-replicas", self.replicas_per_master, "--cluster-yes",
                        node=self.nodes[0], timeout=timeout)
        (self.dir / "create.log").write_text(proc.stdout + proc.stderr)
        check(proc.returncode == 0 and "[OK] All 16384 slots covered" in proc.stdout,
              f"redis-cli --cluster create over ports {[n.client_port for n in self.nodes]} exited "
              f"{proc.returncode} (log {self.dir / 'create.log'}):\n{(proc.stdout + proc.stderr)[-2000:]}")
        self.wait_stable(timeout=max(1.0, timeout - (time.monotonic() - started)))
        self.timings["create"] = time.monotonic() - started
        return self

    async def astart(self, timeout=30.0):
        return await asyncio.to_thread(self.start, timeout)

    def stop(self):
        """Kill every node and background redis-cli (the nodes' dirs stay until the test passes)."""
        for run in self.background:
            run.kill()
        for n in self.nodes:
            n.cleanup(keep=True)

    async def __aenter__(self):
        return await self.astart()

    async def __aexit__(self, *exc):
        self.stop()
        return False

    # -- reading the cluster's state
    def node(self, which):
        """The ClusterNode for a ClusterNode, a port (plain or TLS) or a node id."""
        if isinstance(which, ClusterNode):
            return which
        for n in self.nodes:
            if which in (n.port, n.tls_port, n.node_id):
                return n
        fail(f"no node {which!r} in the cluster (ports {[n.port for n in self.nodes]})")

    def live(self):
        """The nodes running and not paused."""
        live = [n for n in self.nodes if n.alive() and not n.paused]
        check(live, "no node of the cluster is running")
        return live

    def _view(self):
        """CLUSTER NODES from the first live node that answers."""
        last = None
        for n in self.live():
            try:
                return n.cluster_nodes()
            except _errors() as err:
                last = err
        fail(f"no live node answers CLUSTER NODES: {last}")

    def _by_id(self, entries):
        """The nodes of CLUSTER NODES entries, in the order of self.nodes (stable)."""
        ids = {e["id"] for e in entries}
        return [n for n in self.nodes if n.node_id in ids]

    def masters(self):
        """The nodes a live node sees as masters and not failing (fail, fail?), with or
        without slots."""
        return self._by_id([e for e in self._view() if "master" in e["flags"]
                            and not e["flags"] & {"fail", "fail?"}])

    def replicas(self):
        """The nodes a live node sees as replicas (not failing)."""
        return self._by_id([e for e in self._view() if "slave" in e["flags"]
                            and not e["flags"] & {"fail", "fail?"}])

    def replicas_of(self, master):
        master = self.node(master)
        return self._by_id([e for e in self._view() if e["master"] == master.node_id])

    def slots_of(self, node):
        """[(first, last), ...] the slots a live node sees `node` owning."""
        node = self.node(node)
        return next((e["slots"] for e in self._view() if e["id"] == node.node_id), [])

    def master_of_slot(self, slot):
        for e in self._view():
            if any(a <= slot <= b for a, b in e["slots"]):
                return self._by_id([e])[0]
        fail(f"no node owns slot {slot}")

    def key_slot(self, key):
        return self.live()[0].command("CLUSTER", "KEYSLOT", key)

    def _node_state(self, n):
        try:
            info = n.cluster_info()
            return f"{n.role()} {info.get('cluster_state')}/{info.get('cluster_slots_ok')} slots ok/" \
                   f"{info.get('cluster_known_nodes')} nodes"
        except _errors() as err:
            return f"{type(err).__name__}: {err}"

    def describe(self):
        """Each node's ports, role and cluster state, for failure messages."""
        return "; ".join(f"{n.port}{'/' + str(n.tls_port) if n.tls_port else ''} "
                         f"{'down' if not n.alive() else self._node_state(n)}" for n in self.nodes)

    def wait_stable(self, timeout=20.0):
        """Until every live node says cluster_state:ok with all slots assigned and ok, knows
        every node, sees the same slot owners as the others, and each live replica's link to
        its master is up."""
        def stable():
            live = self.live()
            views = []
            for n in live:
                info = n.cluster_info()
                if info.get("cluster_state") != "ok" \
                        or info.get("cluster_slots_assigned") != str(CLUSTER_SLOTS) \
                        or info.get("cluster_slots_ok") != str(CLUSTER_SLOTS) \
                        or info.get("cluster_known_nodes") != str(len(self.nodes)):
                    return False
                views.append(sorted((e["id"], tuple(e["slots"])) for e in n.cluster_nodes() if e["slots"]))
                if n.role() == "slave" and "master_link_status:up" not in n.command("INFO", "replication"):
                    return False
            return all(v == views[0] for v in views)
        wait_for("the cluster is stable (state ok on every node, one slot map, replicas linked)",
                 stable, timeout, self.describe)

    async def await_stable(self, timeout=20.0):
        return await asyncio.to_thread(self.wait_stable, timeout)

    # -- moves
    def kill_master(self, master):
        """SIGKILL a master (kill -9: no goodbye to anyone); its replicas, as seen just
        before, are the ones wait_failover waits for."""
        master = self.node(master)
        check(master.role() == "master", f"node {master.port} is not a master (ROLE {master.role()})")
        self.orphans[master.node_id] = self.replicas_of(master)
        check(self.orphans[master.node_id], f"master {master.port} has no replica to fail over to")
        master.kill()
        self._killed_at[master.node_id] = time.monotonic()
        return master

    def pause_master(self, master):
        """SIGSTOP a master: its connections stay open and nothing is answered, until the
        cluster fails it over (resume() it after: it comes back as a replica)."""
        master = self.node(master)
        check(master.role() == "master", f"node {master.port} is not a master (ROLE {master.role()})")
        self.orphans[master.node_id] = self.replicas_of(master)
        check(self.orphans[master.node_id], f"master {master.port} has no replica to fail over to")
        master.pause()
        self._killed_at[master.node_id] = time.monotonic()
        return master

    def wait_failover(self, old, timeout=20.0):
        """Until a former replica of the killed master `old` is a master owning slots, every
        live node flags `old` as failed and says cluster_state:ok. The new master."""
        old = self.node(old)
        heirs = self.orphans.get(old.node_id) or self.replicas_of(old)
        since = self._killed_at.get(old.node_id, time.monotonic())

        def promoted():
            for h in heirs:
                if not h.alive() or h.role() != "master":
                    continue
                for n in self.live():
                    view = {e["id"]: e for e in n.cluster_nodes()}
                    if "fail" not in view.get(old.node_id, {}).get("flags", ()) \
                            or not view.get(h.node_id, {}).get("slots") \
                            or n.cluster_info().get("cluster_state") != "ok":
                        break
                else:
                    return h
            return None
        new = wait_for(f"a replica ({[h.port for h in heirs]}) of the killed master {old.port} takes over",
                       promoted, timeout, self.describe)
        self.timings["failover"] = time.monotonic() - since
        return new

    async def await_failover(self, old, timeout=20.0):
        return await asyncio.to_thread(self.wait_failover, old, timeout)

    def reshard(self, from_node, to_node, slots, timeout=60, pipeline=None):
        """Start `redis-cli --cluster reshard` moving `slots` slots (and their keys, by
        MIGRATE) from master `from_node` to master `to_node`; returns the ReshardRun at once
        (join() it), so a test can keep sending traffic meanwhile."""
        src, dst = self.node(from_node), self.node(to_node)
        argv = redis_cli_argv(dst.client_port, tls=self.tls, client_cert=self.tls_auth_clients == "yes",
                              password=self.password)
        argv += ["--cluster", "reshard", dst.address, "--cluster-from", src.node_id,
                 "--cluster-to", dst.node_id, "--cluster-slots", str(slots), "--cluster-yes",
                 "--cluster-timeout", str(timeout * 1000)]
        if pipeline:
            argv += ["--cluster-pipeline", str(pipeline)]
        run = ReshardRun(argv, self.dir / f"reshard-{len(self.background) + 1}.log",
                         f"reshard of {slots} slots from {src.address} to {dst.address}")
        self.background.append(run)
        return run

    def acl_user(self, user, password, rules=("~*", "&*", "+@all")):
        """acl_user on every live node (ACLs are per node; Redis Cluster does not spread them)."""
        for n in self.live():
            acl_user(n, user, password, rules)


# --------------------------------------------------------------------------------------
# Sentinel over TLS


class TLSSentinel(harness.RedisServer):
    """test_sentinel.py's Sentinel (quorum 2, down-after 1 s) over TLS: clients ask it on
    `tls_port` (`url`: rediss://), and it talks TLS to the master, replicas and other
    Sentinels (tls-replication yes), so it monitors `primary`'s TLS port and names TLS ports.
    `port` stays plain for the inspection client. Its own config, not a subclass of
    test_sentinel.Sentinel: that one's monitor line names the primary's plain port."""

    def __init__(self, primary, certs, master=SENTINEL_MASTER, tls_auth_clients="no"):
        super().__init__(port=unique_port())
        self.primary = primary
        self.certs = certs
        self.master = master
        self.tls_port = unique_port()
        self.conf = self.dir / "sentinel.conf"
        # Sentinel rewrites its config file: it lives in the server's own temp dir.
        self.conf.write_text(
            f"port {self.port}\nbind 127.0.0.1\ndaemonize no\ndir {self.dir}\n"
            f"tls-port {self.tls_port}\ntls-cert-file {certs.server_cert}\ntls-key-file {certs.server_key}\n"
            f"tls-ca-cert-file {certs.ca}\ntls-auth-clients {tls_auth_clients}\ntls-replication yes\n"
            f"sentinel monitor {master} 127.0.0.1 {primary.tls_port} 2\n"
            f"sentinel down-after-milliseconds {master} 1000\n"
            f"sentinel failover-timeout {master} 6000\n"
            f"sentinel parallel-syncs {master} 1\n"
            + (f"sentinel auth-pass {master} {primary.password}\n" if primary.password else ""))

    @property
    def url(self):
        return f"rediss://127.0.0.1:{self.tls_port}"

    def command_line(self):
        return [harness.REDIS_SERVER, str(self.conf), "--sentinel"]


def sentinel_url(sentinels, master=SENTINEL_MASTER, scheme="rediss-sentinel"):
    """rediss-sentinel://127.0.0.1:T1,127.0.0.1:T2,.../master: the TLSSentinels' TLS ports."""
    return f"{scheme}://" + ",".join(f"127.0.0.1:{s.tls_port}" for s in sentinels) + f"/{master}"


# --------------------------------------------------------------------------------------
# Self-test: python3 redis_topo.py


def _cert_checks(certs):
    def verify(ca, cert):
        proc = subprocess.run([OPENSSL, "verify", "-CAfile", ca, cert], capture_output=True, text=True)
        return proc.returncode == 0, proc.stdout + proc.stderr

    def expired(cert):  # -checkend 0: exit 1 when the certificate has expired
        return subprocess.run([OPENSSL, "x509", "-noout", "-checkend", "0", "-in", cert],
                              capture_output=True, text=True).returncode != 0

    def names(cert):
        return certs.openssl("x509", "-noout", "-ext", "subjectAltName", "-in", cert)

    for attr in ("server_cert", "wrong_name_cert", "client_cert"):
        path = getattr(certs, attr)
        ok, out = verify(certs.ca, path)
        check(ok, f"{attr} {path} does not verify against the CA: {out}")
        check(not expired(path), f"{attr} {path} has expired")
        check(not verify(certs.wrong_ca, path)[0], f"{attr} {path} verifies against the wrong CA")
    ok, out = verify(certs.ca, certs.expired_cert)
    check(not ok and "expired" in out, f"expired_cert {certs.expired_cert}, openssl verify: {out}")
    check(expired(certs.expired_cert), f"openssl x509 -checkend 0: {certs.expired_cert} has not expired")
    check(not verify(certs.ca, certs.wrong_client_cert)[0], "wrong_client_cert verifies against the CA")
    good, wrong, old = names(certs.server_cert), names(certs.wrong_name_cert), names(certs.expired_cert)
    check("DNS:localhost" in good and "IP Address:127.0.0.1" in good, f"server_cert's names: {good}")
    check("DNS:wrong.example" in wrong and "localhost" not in wrong and "127.0.0.1" not in wrong,
          f"wrong_name_cert's names: {wrong}")
    check("DNS:localhost" in old and "IP Address:127.0.0.1" in old, f"expired_cert's names: {old}")


def _tls_server_checks(certs):
    good = TLSRedisServer(certs).start()
    out = good.cli("PING")
    check(out.stdout.strip() == "PONG", f"redis-cli --tls PING on {good.tls_port}: {out.stdout}{out.stderr}")
    bad = good.cli("PING", ca=certs.wrong_ca)
    check(bad.stdout.strip() != "PONG" and "certificate verify failed" in bad.stdout + bad.stderr,
          f"redis-cli trusting the wrong CA got: {bad.stdout}{bad.stderr}")
    probe = tls_probe(good.tls_port, certs.ca)
    check(probe is None, f"TLS to {good.tls_port}: {probe}")
    check(good.command("PING") == "PONG", f"the plain inspection port {good.port} does not answer")
    check(good.url == f"rediss://127.0.0.1:{good.tls_port}", f"url: {good.url}")
    check(good.plain_url == f"redis://127.0.0.1:{good.port}", f"plain_url: {good.plain_url}")

    acl_user(good, "gw", "s3cret")
    ok = good.cli("PING", user="gw", password="s3cret")
    check(ok.stdout.strip() == "PONG", f"ACL user gw: {ok.stdout}{ok.stderr}")
    no = good.cli("PING", user="gw", password="nope")
    check("WRONGPASS" in no.stdout + no.stderr, f"ACL user gw, wrong password: {no.stdout}{no.stderr}")

    wrong_name = TLSRedisServer(certs, cert="wrong_name").start()
    probe = tls_probe(wrong_name.tls_port, certs.ca)
    check(probe and "mismatch" in probe, f"wrong-name server, hostname localhost: {probe}")
    probe = tls_probe(wrong_name.tls_port, certs.ca, hostname=None)
    check(probe is None, f"wrong-name server, no name check: {probe}")
    expired = TLSRedisServer(certs, cert="expired").start()
    probe = tls_probe(expired.tls_port, certs.ca)
    check(probe and "expired" in probe, f"expired server: {probe}")

    mutual = TLSRedisServer(certs, tls_auth_clients="yes", password="pw").start()
    probe = tls_probe(mutual.tls_port, certs.ca, cert=certs.client_cert, key=certs.client_key)
    check(probe is None, f"mutual TLS with the client certificate: {probe}")
    check(tls_probe(mutual.tls_port, certs.ca) is not None,
          "mutual TLS without a client certificate accepted")
    check(tls_probe(mutual.tls_port, certs.ca, cert=certs.wrong_client_cert, key=certs.wrong_client_key)
          is not None, "mutual TLS with the wrong CA's client certificate accepted")
    out = mutual.cli("PING")
    check(out.stdout.strip() == "PONG", f"redis-cli with client cert and password: {out.stdout}{out.stderr}")
    check(mutual.url == f"rediss://:pw@127.0.0.1:{mutual.tls_port}", mutual.url)
    check(with_auth(mutual.url, "gw", "s3cret") == f"rediss://gw:s3cret@127.0.0.1:{mutual.tls_port}",
          with_auth(mutual.url, "gw", "s3cret"))


def _sentinel_checks(certs):
    primary = TLSRedisServer(certs).start()
    replica = TLSRedisServer(certs, replica_of=primary).start()
    wait_for(f"the replica {replica.port} is linked to {primary.tls_port} over TLS",
             lambda: "master_link_status:up" in replica.command("INFO", "replication"), 10)
    sentinels = [TLSSentinel(primary, certs).start() for _ in range(3)]

    def known():
        return [(len(s.command("SENTINEL", "replicas", SENTINEL_MASTER)),
                 len(s.command("SENTINEL", "sentinels", SENTINEL_MASTER))) for s in sentinels]
    wait_for("every TLS Sentinel knows the replica and the other two (replicas, sentinels)",
             lambda: known() == [(1, 2)] * 3, 15, known)

    def named(sentinel):  # asked over TLS, as the gateway will
        out = redis_cli(sentinel.tls_port, "SENTINEL", "get-master-addr-by-name", SENTINEL_MASTER, tls=certs)
        return out.stdout.split()
    tls_ports = ",".join(f"127.0.0.1:{s.tls_port}" for s in sentinels)
    check(sentinel_url(sentinels) == f"rediss-sentinel://{tls_ports}/{SENTINEL_MASTER}",
          sentinel_url(sentinels))
    check(named(sentinels[0]) == ["127.0.0.1", str(primary.tls_port)],
          f"a Sentinel names {named(sentinels[0])}, expected 127.0.0.1 {primary.tls_port}")
    started = time.monotonic()
    check(sentinels[0].command("SENTINEL", "FAILOVER", SENTINEL_MASTER) == "OK", "SENTINEL FAILOVER refused")
    wait_for("after SENTINEL FAILOVER, the Sentinels name the replica's TLS port",
             lambda: all(named(s) == ["127.0.0.1", str(replica.tls_port)] for s in sentinels), 20,
             lambda: [named(s) for s in sentinels])
    # Not waited for: the old primary turns replica ~10 s later (Sentinel waits that long
    # before it reconfigures a master that reports the wrong role).
    print(f"   SENTINEL FAILOVER over TLS: all Sentinels name {replica.tls_port} after "
          f"{time.monotonic() - started:.2f} s", flush=True)


def _cluster_checks(cluster, label):
    t = cluster.timings
    print(f"   {label}: created in {t['create']:.2f} s, seeds {cluster.seeds_url()}", flush=True)
    masters, replicas = cluster.masters(), cluster.replicas()
    check(len(masters) == cluster.n_masters and len(replicas) == len(cluster.nodes) - cluster.n_masters,
          f"{label}: masters {[n.address for n in masters]}, replicas {[n.address for n in replicas]}")
    keys = [f"key:{i}" for i in range(100)]

    # redis-cli -c connects anew at each redirection: thousands of keys over TLS would take
    # seconds of handshakes, so bulk traffic goes by a plain port (`plain`).
    def cli(stdin, plain):
        if plain:
            return redis_cli(cluster.live()[0].port, stdin=stdin, cluster=True, password=cluster.password)
        return cluster.cli(stdin=stdin, cluster=True)

    def set_all(names, value, plain=False):
        out = cli("".join(f"SET {k} {value(k)}\n" for k in names), plain)
        check(replies(out) == ["OK"] * len(names),
              f"{label}: redis-cli -c SET of {len(names)} keys: {out.stdout[-500:]}{out.stderr}")

    def check_all(names, value, when, plain=False):
        got = replies(cli("".join(f"GET {k}\n" for k in names), plain))
        check(got == [value(k) for k in names],
              f"{label}: {when}, redis-cli -c GET of {len(names)} keys answered {got[:8]}...")

    set_all(keys, lambda k: "v" + k)
    check_all(keys, lambda k: "v" + k, "after the SETs")
    slot = cluster.key_slot("key:0")
    owner = cluster.master_of_slot(slot)
    check(owner.command("GET", "key:0") == "vkey:0",
          f"{label}: key:0 (slot {slot}) is not on {owner.address}, master of the slot")
    sizes = {m.port: len(m.keys("key:*")) for m in masters}
    check(sum(sizes.values()) == 100 and all(sizes.values()), f"{label}: keys per master: {sizes}")
    wait_for(f"{label}: every replica holds its master's keys",
             lambda: all(len(r.keys("key:*")) == sizes[m.port]
                         for m in masters for r in cluster.replicas_of(m)), 10)

    victim = masters[0]
    cluster.kill_master(victim)
    new = cluster.wait_failover(victim, timeout=20)
    print(f"   {label}: master {victim.address} killed, replica {new.address} took over "
          f"in {t['failover']:.2f} s", flush=True)
    check_all(keys, lambda k: "v" + k, "after the failover")

    # Keys enough that the 100 slots moved hold some (about 20): MIGRATE must carry them.
    bulk = [f"bulk:{i}" for i in range(3000)]
    set_all(bulk, lambda k: k, plain=True)
    src, dst = [m for m in cluster.masters() if m.node_id != new.node_id][:2]
    before = {s for a, b in cluster.slots_of(dst) for s in range(a, b + 1)}
    run = cluster.reshard(src, dst, 100)
    writes = 0
    while run.running() and writes < 5000:  # traffic meanwhile, through MOVED and ASK
        set_all([f"during:{writes + i}" for i in range(50)], lambda k: "x")
        writes += 50
    run.join()
    cluster.wait_stable()
    moved = {s for a, b in cluster.slots_of(dst) for s in range(a, b + 1)} - before
    check(len(moved) == 100, f"{label}: {len(moved)} slots moved to {dst.address}, expected 100")
    on_dst = sum(dst.command("CLUSTER", "COUNTKEYSINSLOT", s) for s in moved)
    on_src = sum(src.command("CLUSTER", "COUNTKEYSINSLOT", s) for s in moved)
    check(on_dst > 0 and on_src == 0, f"{label}: keys in the moved slots: {on_dst} on {dst.address}, "
          f"{on_src} left on {src.address}")
    check_all(keys, lambda k: "v" + k, "after the reshard")
    check_all(bulk, lambda k: k, "after the reshard", plain=True)
    print(f"   {label}: 100 slots ({on_dst} keys) {src.address} -> {dst.address} in {run.elapsed:.2f} s, "
          f"{writes} SETs meanwhile", flush=True)


async def _selftest(args):
    with step("certificates: CA, wrong CA, good, wrong-name, expired and client certificates"):
        started = time.monotonic()
        certs = CertFactory()
        print(f"   made in {time.monotonic() - started:.2f} s in {certs.dir}", flush=True)
        _cert_checks(certs)
    with step("TLSRedisServer: good, wrong CA, wrong name, expired, mutual TLS, ACL user"):
        _tls_server_checks(certs)
    with step("TLS primary, replica and three TLSSentinels"):
        _sentinel_checks(certs)
    with step("RedisCluster, plain: create, 100 keys, kill a master, failover, reshard 100 slots"):
        cluster = RedisCluster()
        await cluster.astart()
        _cluster_checks(cluster, "plain")
        cluster.stop()
    with step("RedisCluster over mutual TLS (bus and replication too), a password, an ACL user"):
        cluster = RedisCluster(tls=certs, tls_auth_clients="yes", password="pw")
        await cluster.astart()
        cluster.acl_user("gw", "s3cret")
        url = with_auth(cluster.seeds_url(), "gw", "s3cret")
        check(url == "rediss-cluster://gw:s3cret@" + ",".join(n.address for n in cluster.nodes[:3]), url)
        out = cluster.cli("SET", "acl:{x}", "1", cluster=True, user="gw", password="s3cret")
        check(replies(out) == ["OK"], f"ACL user gw on the cluster: {out.stdout}{out.stderr}")
        _cluster_checks(cluster, "tls")
        cluster.stop()


if __name__ == "__main__":
    harness.run(_selftest, timeout=90)
