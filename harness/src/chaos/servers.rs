//! The processes a chaos run starts, faults and cleans up: a private `redis-server`, a
//! private PostgreSQL cluster (made with `initdb` in a temp dir), a private MariaDB server
//! (made with `mariadb-install-db` in a temp dir), a private `moto_server`
//! (the DynamoDB emulator), a small tmpfs for the full-disk fault, and the
//! `idem-harness serve` under test. Everything listens on loopback
//! ports the run is given and lives in temp dirs; dropping a handle kills its processes
//! (by pid) and removes its files.

use std::io::{BufRead, BufReader};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

/// Why a private server could not be started or faulted.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// A command could not run, or failed.
    #[error("{what}: {message}")]
    Failed {
        /// What was being done.
        what: String,
        /// The reason.
        message: String,
    },
}

fn failed(what: impl Into<String>, message: impl std::fmt::Display) -> ServerError {
    ServerError::Failed { what: what.into(), message: message.to_string() }
}

/// Sends `signal` (e.g. `STOP`, `CONT`, `KILL`, `QUIT`) to one process by its id.
///
/// # Errors
/// [`ServerError`] when `kill` cannot run or refuses.
pub fn signal(pid: u32, signal: &str) -> Result<(), ServerError> {
    let status = Command::new("kill")
        .arg(format!("-{signal}"))
        .arg(pid.to_string())
        .stderr(Stdio::null())
        .status()
        .map_err(|e| failed("kill", e))?;
    if !status.success() {
        return Err(failed(format!("kill -{signal} {pid}"), status));
    }
    Ok(())
}

/// Waits until something accepts connections on `127.0.0.1:port`.
fn wait_port(port: u16, within: Duration) -> Result<(), ServerError> {
    let end = Instant::now() + within;
    while Instant::now() < end {
        if TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return Ok(());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    Err(failed(format!("127.0.0.1:{port}"), "nothing listening"))
}

/// Kills `child` with SIGKILL and reaps it.
fn kill_child(child: &mut Child) {
    let _ = child.kill();
    let _ = child.wait();
}

/// How a private Redis persists, as its `appendonly`/`appendfsync`/`save` settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RedisPersistence {
    /// AOF with `appendfsync always`: every write is fsynced before the reply.
    AofAlways,
    /// AOF with `appendfsync everysec`: written before the reply, fsynced once a second.
    AofEverysec,
    /// No AOF and no RDB snapshots: a restart starts empty.
    None,
}

impl RedisPersistence {
    /// The name in the chaos table.
    #[must_use]
    pub fn label(self) -> &'static str {
        match self {
            RedisPersistence::AofAlways => "AOF always",
            RedisPersistence::AofEverysec => "AOF everysec",
            RedisPersistence::None => "no persistence",
        }
    }
}

/// A `redis-server` of this run's own, in a temp dir.
#[derive(Debug)]
pub struct PrivateRedis {
    port: u16,
    persistence: RedisPersistence,
    dir: TempDir,
    child: Option<Child>,
}

impl PrivateRedis {
    /// Starts `redis-server` on `127.0.0.1:port` with `persistence`.
    ///
    /// # Errors
    /// [`ServerError`] when it cannot start or does not listen within 10 s.
    pub fn start(port: u16, persistence: RedisPersistence) -> Result<Self, ServerError> {
        let dir = tempfile::tempdir().map_err(|e| failed("temp dir", e))?;
        let mut redis = Self { port, persistence, dir, child: None };
        redis.spawn()?;
        Ok(redis)
    }

    fn spawn(&mut self) -> Result<(), ServerError> {
        let (aof, fsync) = match self.persistence {
            RedisPersistence::AofAlways => ("yes", "always"),
            RedisPersistence::AofEverysec => ("yes", "everysec"),
            RedisPersistence::None => ("no", "everysec"),
        };
        let child = Command::new("redis-server")
            .args(["--bind", "127.0.0.1", "--port", &self.port.to_string(), "--save", ""])
            .args(["--appendonly", aof, "--appendfsync", fsync, "--daemonize", "no"])
            .arg("--dir")
            .arg(self.dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| failed("redis-server (install Debian's redis-server package)", e))?;
        self.child = Some(child);
        wait_port(self.port, Duration::from_secs(10))
    }

    /// `redis://127.0.0.1:PORT`.
    #[must_use]
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// The server's process id.
    #[must_use]
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Kills the server (SIGKILL: a crash, nothing flushed on the way out).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            kill_child(&mut c);
        }
    }

    /// Starts the server again on the same dir and port.
    ///
    /// # Errors
    /// [`ServerError`] when it does not come back.
    pub fn restart(&mut self) -> Result<(), ServerError> {
        self.kill();
        self.spawn()
    }
}

impl Drop for PrivateRedis {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A six-node Redis Cluster of this run's own (three primaries, one replica each, node
/// timeout 1 s, AOF `everysec`): `redis-server` on `base..base + 6` (bus ports 10000 above)
/// in a temp dir, joined with `redis-cli --cluster create`.
#[derive(Debug)]
pub struct PrivateCluster {
    base: u16,
    _dir: TempDir,
    children: Vec<Option<Child>>,
}

impl PrivateCluster {
    /// Starts the nodes and joins them; returns once `redis-cli --cluster check` passes.
    ///
    /// # Errors
    /// [`ServerError`] when a node does not start or the cluster does not form in 30 s.
    pub fn start(base: u16) -> Result<Self, ServerError> {
        let dir = tempfile::tempdir().map_err(|e| failed("temp dir", e))?;
        let mut children = Vec::new();
        for port in base..base + 6 {
            let node_dir = dir.path().join(port.to_string());
            std::fs::create_dir_all(&node_dir).map_err(|e| failed("node dir", e))?;
            let child = Command::new("redis-server")
                .args(["--bind", "127.0.0.1", "--port", &port.to_string(), "--save", ""])
                .args(["--appendonly", "yes", "--appendfsync", "everysec", "--cluster-enabled", "yes"])
                .args(["--cluster-node-timeout", "1000", "--dir"])
                .arg(&node_dir)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .map_err(|e| failed("redis-server (install Debian's redis-server package)", e))?;
            children.push(Some(child));
        }
        let cluster = Self { base, _dir: dir, children };
        for port in base..base + 6 {
            wait_port(port, Duration::from_secs(10))?;
        }
        let addrs: Vec<String> = (base..base + 6).map(|p| format!("127.0.0.1:{p}")).collect();
        let status = Command::new("redis-cli")
            .args(["--cluster", "create"])
            .args(&addrs)
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map_err(|e| failed("redis-cli (install Debian's redis-tools package)", e))?;
        if !status.success() {
            return Err(failed("redis-cli --cluster create", status));
        }
        let end = Instant::now() + Duration::from_secs(30);
        while !cluster.healthy() {
            if Instant::now() > end {
                return Err(failed("private Redis Cluster", "not healthy within 30 s"));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Ok(cluster)
    }

    /// Every node says `cluster_state:ok` and each replica's link to its primary is up.
    fn healthy(&self) -> bool {
        (self.base..self.base + 6).all(|port| {
            let cli = |args: &[&str]| {
                Command::new("redis-cli").args(["-p", &port.to_string()]).args(args).output().map(|o| o.stdout)
            };
            let (Ok(info), Ok(repl)) = (cli(&["cluster", "info"]), cli(&["info", "replication"])) else { return false };
            let (info, repl) = (String::from_utf8_lossy(&info), String::from_utf8_lossy(&repl));
            info.contains("cluster_state:ok")
                && (repl.contains("role:master") || repl.contains("master_link_status:up"))
        })
    }

    /// `redis-cluster://127.0.0.1:BASE,...` as the server under test takes it.
    #[must_use]
    pub fn url(&self) -> String {
        let nodes: Vec<String> = (self.base..self.base + 6).map(|p| format!("127.0.0.1:{p}")).collect();
        format!("redis-cluster://{}", nodes.join(","))
    }

    /// The port of a primary that has a replica (the first, in port order).
    #[must_use]
    pub fn first_primary(&self) -> u16 {
        self.base
    }

    /// SIGKILLs the node on `port`, and leaves it dead.
    pub fn kill(&mut self, port: u16) {
        if let Some(mut c) = self.children.get_mut(usize::from(port - self.base)).and_then(Option::take) {
            kill_child(&mut c);
        }
    }
}

impl Drop for PrivateCluster {
    fn drop(&mut self) {
        for c in self.children.iter_mut().flatten() {
            kill_child(c);
        }
    }
}

/// A PostgreSQL cluster of this run's own: `initdb` in a temp dir, `postgres` on a
/// private port, trust authentication on loopback. Run as the `postgres` user when this
/// process is root (PostgreSQL refuses to run as root).
#[derive(Debug)]
pub struct PrivatePostgres {
    port: u16,
    bin: PathBuf,
    dir: TempDir,
    child: Option<Child>,
}

/// The newest `/usr/lib/postgresql/*/bin` holding `initdb`.
fn postgres_bin() -> Result<PathBuf, ServerError> {
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib/postgresql")
        .map_err(|e| failed("/usr/lib/postgresql (install Debian's postgresql package)", e))?
        .filter_map(|e| Some(e.ok()?.path().join("bin")))
        .filter(|p| p.join("initdb").exists())
        .collect();
    found.sort_by_key(|p| p.parent().and_then(|v| v.file_name()?.to_str()?.parse::<u32>().ok()).unwrap_or(0));
    found.pop().ok_or_else(|| failed("initdb", "no /usr/lib/postgresql/*/bin/initdb"))
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().is_ok_and(|o| o.stdout.starts_with(b"0\n"))
}

/// `program` run as the `postgres` user when this process is root.
fn as_postgres(program: &Path) -> Command {
    if is_root() {
        let mut c = Command::new("setpriv");
        c.args(["--reuid=postgres", "--regid=postgres", "--init-groups", "--"]).arg(program);
        c
    } else {
        Command::new(program)
    }
}

impl PrivatePostgres {
    /// Makes a cluster with `initdb` and starts it on `127.0.0.1:port`.
    ///
    /// # Errors
    /// [`ServerError`] when `initdb` or `postgres` fail, or it does not listen in 30 s.
    pub fn start(port: u16) -> Result<Self, ServerError> {
        let bin = postgres_bin()?;
        let dir = tempfile::Builder::new().prefix("idem-chaos-pg").tempdir().map_err(|e| failed("temp dir", e))?;
        if is_root() {
            let status = Command::new("chown")
                .arg("postgres:postgres")
                .arg(dir.path())
                .status()
                .map_err(|e| failed("chown", e))?;
            if !status.success() {
                return Err(failed("chown postgres", status));
            }
        }
        let out = as_postgres(&bin.join("initdb"))
            .arg("-D")
            .arg(dir.path().join("data"))
            .args(["-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"])
            .output()
            .map_err(|e| failed("initdb", e))?;
        if !out.status.success() {
            return Err(failed("initdb", String::from_utf8_lossy(&out.stderr)));
        }
        let mut pg = Self { port, bin, dir, child: None };
        pg.spawn()?;
        Ok(pg)
    }

    fn spawn(&mut self) -> Result<(), ServerError> {
        let log = std::fs::File::create(self.dir.path().join("postgres.log")).map_err(|e| failed("log", e))?;
        let child = as_postgres(&self.bin.join("postgres"))
            .arg("-D")
            .arg(self.dir.path().join("data"))
            .args(["-p", &self.port.to_string(), "-c", "listen_addresses=127.0.0.1", "-k"])
            .arg(self.dir.path())
            .args(["-c", "fsync=on", "-c", "max_connections=100"])
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .map_err(|e| failed("postgres", e))?;
        self.child = Some(child);
        wait_port(self.port, Duration::from_secs(30))?;
        // The port opens before the cluster accepts queries (startup recovery): wait for it.
        let end = Instant::now() + Duration::from_secs(30);
        while Instant::now() < end {
            if self.psql("SELECT 1").is_ok() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(failed("postgres", "did not accept queries within 30 s"))
    }

    /// `postgres://postgres@127.0.0.1:PORT/postgres`.
    #[must_use]
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// Runs one statement with `psql`.
    ///
    /// # Errors
    /// [`ServerError`] when `psql` fails.
    pub fn psql(&self, sql: &str) -> Result<String, ServerError> {
        let out = Command::new("psql")
            .args(["-X", "-q", "-t", "-A", "-h", "127.0.0.1", "-p", &self.port.to_string(), "-U", "postgres"])
            .args(["-d", "postgres", "-c", sql])
            .output()
            .map_err(|e| failed("psql", e))?;
        if !out.status.success() {
            return Err(failed("psql", String::from_utf8_lossy(&out.stderr)));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// `pg_terminate_backend` of every other client connection (the store's pool):
    /// returns how many were terminated.
    ///
    /// # Errors
    /// [`ServerError`] when `psql` fails.
    pub fn terminate_backends(&self) -> Result<u64, ServerError> {
        let out = self.psql(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
             WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()",
        )?;
        Ok(out.trim().parse().unwrap_or(0))
    }

    /// Stops the whole server with SIGSTOP and returns the ids stopped (resume each with
    /// SIGCONT). The postmaster is stopped first and its children are read after: a backend
    /// it forked for a connection still being opened would otherwise keep serving queries.
    ///
    /// # Errors
    /// [`ServerError`] when a signal cannot be sent.
    pub fn stop(&self) -> Result<Vec<u32>, ServerError> {
        let Some(&postmaster) = self.pids().first() else { return Ok(Vec::new()) };
        signal(postmaster, "STOP")?;
        let mut stopped = vec![postmaster];
        // A child that exited in between (an autovacuum worker) serves nothing and is
        // left out, so resuming the returned ids cannot fail on it.
        stopped.extend(self.pids().into_iter().skip(1).filter(|&p| signal(p, "STOP").is_ok()));
        Ok(stopped)
    }

    /// The postmaster's id and its children's (backends, checkpointer, WAL writer...).
    #[must_use]
    pub fn pids(&self) -> Vec<u32> {
        let Some(pid) = self.child.as_ref().map(Child::id) else { return Vec::new() };
        let children = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
        std::iter::once(pid).chain(children.split_whitespace().filter_map(|p| p.parse().ok())).collect()
    }

    /// Immediate shutdown (SIGQUIT to the postmaster, what `pg_ctl stop -m immediate`
    /// sends: no checkpoint, crash recovery on the next start), then a start.
    ///
    /// # Errors
    /// [`ServerError`] when it does not come back.
    pub fn immediate_restart(&mut self) -> Result<(), ServerError> {
        if let Some(mut c) = self.child.take() {
            let _ = signal(c.id(), "QUIT");
            let _ = c.wait();
        }
        self.spawn()
    }
}

impl Drop for PrivatePostgres {
    fn drop(&mut self) {
        let pids = self.pids();
        // Resume first (a stalled run may have stopped them), then kill by id.
        for &p in &pids {
            let _ = signal(p, "CONT");
        }
        for &p in pids.iter().skip(1) {
            let _ = signal(p, "KILL");
        }
        if let Some(mut c) = self.child.take() {
            kill_child(&mut c);
        }
    }
}

/// A MariaDB server of this run's own: `mariadb-install-db` into a temp dir, `mariadbd` on
/// a private loopback port with a socket in that dir, `root` without a password, database
/// `chaos`. Run as the `mysql` user when this process is root (`mariadbd` refuses to run as
/// root unless told to, and drops to `--user` itself, so its process id stays the one this
/// handle signals). InnoDB keeps its defaults where they decide durability (the redo log
/// flushed at every commit, the doublewrite buffer on) and is only made small.
#[derive(Debug)]
pub struct PrivateMariaDB {
    port: u16,
    dir: TempDir,
    child: Option<Child>,
}

const MARIADBD: &str = "/usr/sbin/mariadbd";
const MARIADB_INSTALL_DB: &str = "/usr/bin/mariadb-install-db";

/// The database the store's tables go in.
const MARIADB_DATABASE: &str = "chaos";

impl PrivateMariaDB {
    /// Makes a data dir with `mariadb-install-db`, starts `mariadbd` on `127.0.0.1:port` and
    /// creates the database.
    ///
    /// # Errors
    /// [`ServerError`] when the install, the server or the `CREATE DATABASE` fail, or it
    /// does not accept queries within 30 s.
    pub fn start(port: u16) -> Result<Self, ServerError> {
        let dir = tempfile::Builder::new().prefix("idem-chaos-mariadb").tempdir().map_err(|e| failed("temp dir", e))?;
        if is_root() {
            let status =
                Command::new("chown").arg("mysql:mysql").arg(dir.path()).status().map_err(|e| failed("chown", e))?;
            if !status.success() {
                return Err(failed("chown mysql", status));
            }
        }
        let mut install = Command::new(MARIADB_INSTALL_DB);
        // `--no-defaults` first: the machine's my.cnf (the shared server's port, socket and
        // data dir) must not leak in.
        install.arg("--no-defaults");
        if is_root() {
            install.arg("--user=mysql");
        }
        let out = install
            .arg(format!("--datadir={}", dir.path().join("data").display()))
            // `root` without a password over TCP (root@127.0.0.1), as the shared server in
            // `scripts/services` is reached; no `test` database, the run makes its own.
            .args(["--auth-root-authentication-method=normal", "--skip-test-db"])
            .args(Self::innodb_args())
            .output()
            .map_err(|e| failed(format!("{MARIADB_INSTALL_DB} (install Debian's mariadb-server package)"), e))?;
        if !out.status.success() {
            return Err(failed(
                "mariadb-install-db",
                format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr)),
            ));
        }
        let mut db = Self { port, dir, child: None };
        db.spawn()?;
        db.sql(&format!("CREATE DATABASE IF NOT EXISTS {MARIADB_DATABASE}"))?;
        Ok(db)
    }

    /// Small, not weakened: a 64 MiB buffer pool and a 16 MiB redo log, so a data dir
    /// per fault stays cheap; `innodb_flush_log_at_trx_commit` and the doublewrite buffer
    /// keep their durable defaults (a SIGKILL must lose no committed record).
    fn innodb_args() -> [&'static str; 2] {
        ["--innodb-buffer-pool-size=64M", "--innodb-log-file-size=16M"]
    }

    fn spawn(&mut self) -> Result<(), ServerError> {
        let mut cmd = Command::new(MARIADBD);
        cmd.arg("--no-defaults");
        if is_root() {
            cmd.arg("--user=mysql");
        }
        let path = self.dir.path();
        let child = cmd
            .arg(format!("--datadir={}", path.join("data").display()))
            .arg(format!("--socket={}", path.join("mariadbd.sock").display()))
            .arg(format!("--pid-file={}", path.join("mariadbd.pid").display()))
            .arg(format!("--log-error={}", path.join("mariadbd.log").display()))
            .args([&format!("--port={}", self.port), "--bind-address=127.0.0.1"])
            // Connections from 127.0.0.1 match root@127.0.0.1 without a DNS lookup.
            .arg("--skip-name-resolve")
            .args(Self::innodb_args())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| failed(format!("{MARIADBD} (install Debian's mariadb-server package)"), e))?;
        self.child = Some(child);
        wait_port(self.port, Duration::from_secs(30))?;
        // Ready means a query passes, not only an open port (the same check the start's
        // `CREATE DATABASE` and a restart's crash recovery need).
        let end = Instant::now() + Duration::from_secs(30);
        while Instant::now() < end {
            if self.sql("SELECT 1").is_ok() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(failed(
            "mariadbd",
            format!("did not accept queries within 30 s; see {}", path.join("mariadbd.log").display()),
        ))
    }

    /// `mysql://root@127.0.0.1:PORT/chaos`.
    #[must_use]
    pub fn url(&self) -> String {
        format!("mysql://root@127.0.0.1:{}/{MARIADB_DATABASE}", self.port)
    }

    /// Runs one statement with the `mariadb` client, over TCP as the store connects.
    ///
    /// # Errors
    /// [`ServerError`] when the client fails.
    pub fn sql(&self, sql: &str) -> Result<String, ServerError> {
        let out = Command::new("mariadb")
            .args(["--no-defaults", "--protocol=TCP", "-h", "127.0.0.1", "-P", &self.port.to_string(), "-u", "root"])
            .args(["--batch", "--skip-column-names", "--connect-timeout=5", "-e", sql])
            .output()
            .map_err(|e| failed("mariadb client", e))?;
        if !out.status.success() {
            return Err(failed("mariadb client", String::from_utf8_lossy(&out.stderr)));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The server's process id (one process: SIGSTOP to it stops every thread).
    #[must_use]
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Kills the server (SIGKILL: a crash, no clean shutdown, InnoDB recovers from its
    /// redo log on the next start).
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            // A stalled run may have stopped it: resume, so the kill is reaped at once.
            let _ = signal(c.id(), "CONT");
            kill_child(&mut c);
        }
    }

    /// Starts the server again on the same data dir and port (crash recovery when it was
    /// killed).
    ///
    /// # Errors
    /// [`ServerError`] when it does not come back.
    pub fn restart(&mut self) -> Result<(), ServerError> {
        self.kill();
        self.spawn()
    }
}

impl Drop for PrivateMariaDB {
    fn drop(&mut self) {
        self.kill();
    }
}

/// `moto_server` with werkzeug's threads off, as `scripts/moto` runs it: moto's DynamoDB
/// takes no lock, so its threaded server lets two conditional writes to one item both
/// pass; one request at a time is the atomicity DynamoDB itself gives.
const MOTO_ONE_AT_A_TIME: &str = r#"
import sys
import moto.server as server
import werkzeug.serving as serving

run_simple = serving.run_simple
server.run_simple = lambda *a, **k: run_simple(*a, **{**k, "threaded": False})
server.main(sys.argv[1:])
"#;

/// The Python interpreter itself, not the `python3` on the path: that may be a wrapper
/// (pyenv's shim is a shell script that runs Python as its child), and SIGSTOP to a
/// wrapper's id would stall nothing.
fn python() -> Result<PathBuf, ServerError> {
    let out = Command::new("python3")
        .args(["-c", "import sys; print(sys.executable)"])
        .output()
        .map_err(|e| failed("python3 (moto_server needs it)", e))?;
    let path = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    if !out.status.success() || path.is_empty() {
        return Err(failed("python3", String::from_utf8_lossy(&out.stderr)));
    }
    Ok(PathBuf::from(path))
}

/// A `moto_server` (DynamoDB emulator, moto 5.x from PyPI: `pip install 'moto[server]'`)
/// of this run's own: one Python process on a private loopback port, in a temp dir, its
/// tables in memory. Slow (one request at a time, in Python): a storm against it is sized
/// for that.
#[derive(Debug)]
pub struct PrivateMoto {
    port: u16,
    _dir: TempDir,
    child: Option<Child>,
}

impl PrivateMoto {
    /// Starts `moto_server` on `127.0.0.1:port`, serving one request at a time.
    ///
    /// # Errors
    /// [`ServerError`] when `python3` cannot run or nothing listens within 30 s.
    pub fn start(port: u16) -> Result<Self, ServerError> {
        let dir = tempfile::Builder::new().prefix("idem-chaos-moto").tempdir().map_err(|e| failed("temp dir", e))?;
        let log = std::fs::File::create(dir.path().join("moto.log")).map_err(|e| failed("log", e))?;
        let child = Command::new(python()?)
            .arg("-c")
            .arg(MOTO_ONE_AT_A_TIME)
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .current_dir(dir.path())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log))
            .spawn()
            .map_err(|e| failed("moto_server (python3 -m pip install 'moto[server]>=5,<6')", e))?;
        let mut moto = Self { port, _dir: dir, child: Some(child) };
        if let Err(e) = wait_port(port, Duration::from_secs(30)) {
            moto.kill();
            return Err(e);
        }
        Ok(moto)
    }

    /// `http://127.0.0.1:PORT`.
    #[must_use]
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// The server's process id.
    #[must_use]
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            // A stalled run may have stopped it: resume, so the kill is reaped at once.
            let _ = signal(c.id(), "CONT");
            kill_child(&mut c);
        }
    }
}

impl Drop for PrivateMoto {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A tmpfs of a few MiB mounted on a temp dir: the full-disk fault. Needs root (mount).
#[derive(Debug)]
pub struct SmallDisk {
    dir: TempDir,
}

impl SmallDisk {
    /// Mounts a tmpfs of `mib` MiB.
    ///
    /// # Errors
    /// [`ServerError`] when `mount` fails (not root, no tmpfs).
    pub fn mount(mib: u32) -> Result<Self, ServerError> {
        let dir = tempfile::Builder::new().prefix("idem-chaos-disk").tempdir().map_err(|e| failed("temp dir", e))?;
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
            .arg(dir.path())
            .output()
            .map_err(|e| failed("mount", e))?;
        if !out.status.success() {
            return Err(failed("mount tmpfs (the full-disk fault needs root)", String::from_utf8_lossy(&out.stderr)));
        }
        Ok(Self { dir })
    }

    /// The mount point.
    #[must_use]
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Fills the disk with a filler file until a write fails: returns its size, bytes.
    ///
    /// # Errors
    /// [`ServerError`] when the filler cannot be created.
    pub fn fill(&self) -> Result<u64, ServerError> {
        use std::io::Write;
        let mut f = std::fs::File::create(self.filler()).map_err(|e| failed("filler", e))?;
        let chunk = vec![0u8; 64 * 1024];
        let mut written = 0u64;
        while f.write_all(&chunk).is_ok() {
            written += chunk.len() as u64;
        }
        // The last partial chunks, byte by byte in powers of two, so nothing is left free.
        let mut size = 32 * 1024;
        while size > 0 {
            while f.write_all(&chunk[..size]).is_ok() {
                written += size as u64;
            }
            size /= 2;
        }
        Ok(written)
    }

    /// Frees the disk again.
    pub fn free(&self) {
        let _ = std::fs::remove_file(self.filler());
    }

    fn filler(&self) -> PathBuf {
        self.dir.path().join("filler")
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(self.dir.path()).status();
    }
}

/// `idem-harness serve` under test, as a child process (so the run can SIGKILL it).
#[derive(Debug)]
pub struct AppServer {
    exe: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    port: u16,
    log: PathBuf,
    child: Option<Child>,
}

impl AppServer {
    /// Starts `exe serve --addr 127.0.0.1:PORT` with `args` (store, state, lease, faults)
    /// and `env` added to its environment (the emulator's dummy AWS credentials), appending
    /// its stderr to `log`, and waits for its `LISTENING` line.
    ///
    /// # Errors
    /// [`ServerError`] when it does not start within 30 s.
    pub fn start(
        exe: &Path,
        port: u16,
        args: Vec<String>,
        env: Vec<(String, String)>,
        log: &Path,
    ) -> Result<Self, ServerError> {
        let mut app = Self { exe: exe.to_path_buf(), args, env, port, log: log.to_path_buf(), child: None };
        app.spawn()?;
        Ok(app)
    }

    fn spawn(&mut self) -> Result<(), ServerError> {
        let log =
            std::fs::OpenOptions::new().create(true).append(true).open(&self.log).map_err(|e| failed("log", e))?;
        let mut child = Command::new(&self.exe)
            .args(["serve", "--addr", &format!("127.0.0.1:{}", self.port)])
            .args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .env_remove("LEASEBROKER_CRASH_AT")
            .env_remove("LEASEBROKER_CRASH_RATE")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log))
            .spawn()
            .map_err(|e| failed(format!("{} serve", self.exe.display()), e))?;
        let stdout = child.stdout.take().ok_or_else(|| failed("serve", "no stdout"))?;
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if line.starts_with("LISTENING ") {
                    let _ = tx.send(());
                }
            }
        });
        self.child = Some(child);
        match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(()) => Ok(()),
            Err(_) => {
                self.kill();
                Err(failed("idem-harness serve", format!("did not start; see {}", self.log.display())))
            }
        }
    }

    /// `http://127.0.0.1:PORT`.
    #[must_use]
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// SIGKILL.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            kill_child(&mut c);
        }
    }

    /// SIGKILL, then a start with the same arguments.
    ///
    /// # Errors
    /// [`ServerError`] when it does not come back.
    pub fn restart(&mut self) -> Result<(), ServerError> {
        self.kill();
        self.spawn()
    }
}

impl Drop for AppServer {
    fn drop(&mut self) {
        self.kill();
    }
}
