//! PostgreSQL for the tests: a schema of its own in the machine's server for
//! each test ([`TestSchema`]), and throwaway clusters ([`PgCluster`]) for the
//! tests that stop the server or need `pg_stat_statements`.
//!
//! The machine's server is the one `scripts/setup.sh` installs and starts:
//! 127.0.0.1:5432, user `postgres`, trust authentication. When it cannot be
//! reached the tests fail (never skip) with a message naming that script.

use crate::free_port;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tempfile::TempDir;
use tokio_postgres::{Client, NoTls};

/// The machine's server.
pub const HOST: &str = "127.0.0.1";
pub const PORT: u16 = 5432;
/// The database the tests' schemas live in (created on first use).
pub const TEST_DATABASE: &str = "sidelock_test";

/// `postgres://postgres@HOST:PORT/DB`.
pub fn url(port: u16, database: &str) -> String {
    format!("postgres://postgres@{HOST}:{port}/{database}")
}

/// Connects to `url`, driving the connection in a task.
pub async fn connect(url: &str) -> Result<Client, tokio_postgres::Error> {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

/// A client of the machine's server, or a failure that says how to start it.
pub async fn connect_machine(database: &str) -> Client {
    let url = url(PORT, database);
    match tokio::time::timeout(Duration::from_secs(10), connect(&url)).await {
        Ok(Ok(client)) => client,
        Ok(Err(e)) => panic!(
            "PostgreSQL is not reachable at {url} ({e:?}); run scripts/setup.sh, which installs \
             and starts it (user postgres, trust authentication on 127.0.0.1)"
        ),
        Err(_) => panic!(
            "PostgreSQL did not answer at {url} within 10 s; run scripts/setup.sh, which installs and starts it"
        ),
    }
}

/// Creates [`TEST_DATABASE`] unless it exists (tests run in parallel processes).
async fn ensure_test_database() {
    let admin = connect_machine("postgres").await;
    let exists = admin
        .query_opt(
            "SELECT 1 FROM pg_database WHERE datname = $1",
            &[&TEST_DATABASE],
        )
        .await
        .expect("query pg_database");
    if exists.is_none()
        && let Err(e) = admin
            .batch_execute(&format!("CREATE DATABASE {TEST_DATABASE}"))
            .await
    {
        // Another test process created it meanwhile.
        let code = e.code().map(|c| c.code().to_owned());
        assert!(
            matches!(code.as_deref(), Some("42P04" | "23505")),
            "create database {TEST_DATABASE}: {e:?}"
        );
    }
}

/// A unique lower-case identifier: `<prefix>_<pid>_<counter>_<nanos>`.
pub fn unique_ident(prefix: &str) -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("{prefix}_{}_{n}_{nanos:08x}", std::process::id())
}

/// A schema of its own for one test in [`TEST_DATABASE`]; sidecars create
/// it (`--pg-schema`), dropping the guard drops it with everything in it.
pub struct TestSchema {
    pub name: String,
    pub url: String,
}

impl TestSchema {
    pub async fn new() -> Self {
        ensure_test_database().await;
        Self {
            name: unique_ident("t"),
            url: url(PORT, TEST_DATABASE),
        }
    }

    /// A client of the test database.
    pub async fn client(&self) -> Client {
        connect_machine(TEST_DATABASE).await
    }

    /// `"<schema>".<table>`.
    pub fn table(&self, table: &str) -> String {
        format!("\"{}\".{table}", self.name)
    }
}

impl Drop for TestSchema {
    fn drop(&mut self) {
        // Drop runs inside the test's runtime: psql rather than blocking on async.
        psql_machine(
            TEST_DATABASE,
            &format!("DROP SCHEMA IF EXISTS \"{}\" CASCADE", self.name),
        );
    }
}

/// A database of its own on the machine's server, dropped (with its
/// connections) when the guard is.
pub struct TestDatabase {
    pub name: String,
}

impl TestDatabase {
    pub async fn new() -> Self {
        let name = unique_ident("db");
        connect_machine("postgres")
            .await
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .unwrap_or_else(|e| panic!("create database {name}: {e:?}"));
        Self { name }
    }

    pub fn url(&self) -> String {
        url(PORT, &self.name)
    }

    pub async fn client(&self) -> Client {
        connect_machine(&self.name).await
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        psql_machine(
            "postgres",
            &format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name),
        );
    }
}

/// Runs one statement on the machine's server with psql (for `Drop`, which
/// cannot await), reporting failures on stderr.
pub fn psql_machine(database: &str, sql: &str) {
    let out = Command::new("psql")
        .args(["-h", HOST, "-p", &PORT.to_string(), "-U", "postgres", "-d"])
        .arg(database)
        .args(["-q", "-v", "ON_ERROR_STOP=1", "-c", sql])
        .output();
    match out {
        Ok(out) if out.status.success() => {}
        Ok(out) => eprintln!("{sql}: {}", String::from_utf8_lossy(&out.stderr)),
        Err(e) => eprintln!("{sql}: cannot run psql: {e}"),
    }
}

/// The newest installed server binaries (`/usr/lib/postgresql/<version>/bin`).
fn server_bin() -> PathBuf {
    let root = Path::new("/usr/lib/postgresql");
    let mut versions: Vec<(u32, PathBuf)> = std::fs::read_dir(root)
        .unwrap_or_else(|e| {
            panic!(
                "{}: {e}; run scripts/setup.sh, which installs PostgreSQL",
                root.display()
            )
        })
        .filter_map(|entry| {
            let entry = entry.ok()?;
            let version = entry.file_name().to_str()?.parse().ok()?;
            Some((version, entry.path().join("bin")))
        })
        .filter(|(_, bin)| bin.join("initdb").exists())
        .collect();
    versions.sort();
    versions
        .pop()
        .map(|(_, bin)| bin)
        .expect("no PostgreSQL server under /usr/lib/postgresql; run scripts/setup.sh")
}

/// libfaketime's library, which `scripts/setup.sh` installs.
pub fn faketime_library() -> PathBuf {
    let found = std::fs::read_dir("/usr/lib")
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .map(|dir| dir.path().join("faketime/libfaketime.so.1"))
        .find(|lib| lib.exists());
    found.expect("libfaketime is not installed; run scripts/setup.sh, which installs it")
}

/// A PostgreSQL cluster of its own on a free port, in a temporary directory:
/// stopping and starting it disturbs no other test. `pg_stat_statements` is
/// preloaded. Runs as the `postgres` OS user when the tests run as root
/// (PostgreSQL refuses root). Dropping it stops the server and removes the
/// directory; the server log is printed if the test is failing.
pub struct PgCluster {
    bin: PathBuf,
    data: PathBuf,
    log: PathBuf,
    port: u16,
    as_root: bool,
    /// The `postgres` user's password when TCP clients must give one
    /// (scram-sha-256); [`Self::url`] then carries it.
    password: Option<String>,
    /// The file libfaketime reads the server's clock offset from, when a
    /// test steps the server's clock ([`Self::step_clock`]).
    clock: Option<PathBuf>,
    // Last, so the server is stopped before the directory goes.
    dir: TempDir,
}

impl PgCluster {
    pub fn start() -> Self {
        Self::start_listening_on(&[])
    }

    /// Starts a cluster that also listens on `addresses` (a test's own
    /// network namespace links) and trusts clients from 10.0.0.0/8.
    pub fn start_listening_on(addresses: &[&str]) -> Self {
        Self::start_configured(addresses, None)
    }

    /// Starts a cluster whose TCP clients must authenticate as `postgres`
    /// with `password` (scram-sha-256).
    pub fn start_with_password(password: &str) -> Self {
        Self::start_configured(&[], Some(password))
    }

    /// Starts a cluster whose clock a test can step ([`Self::step_clock`]):
    /// the server runs under libfaketime (`scripts/setup.sh` installs it),
    /// which reads the offset from a file at every clock read. Monotonic
    /// clocks stay real, so the server's timers are unaffected.
    pub fn start_with_steppable_clock() -> Self {
        Self::start_with(&[], None, true)
    }

    /// Steps the server's wall clock to `offset` from the real one, in
    /// libfaketime's notation: `"+5"` is five seconds ahead, `"-2"` two behind.
    ///
    /// # Panics
    /// When the cluster was not started with a steppable clock.
    pub fn step_clock(&self, offset: &str) {
        let file = self
            .clock
            .as_ref()
            .expect("a cluster started with start_with_steppable_clock");
        std::fs::write(file, format!("{offset}\n")).expect("write the clock offset");
    }

    fn start_configured(addresses: &[&str], password: Option<&str>) -> Self {
        Self::start_with(addresses, password, false)
    }

    fn start_with(addresses: &[&str], password: Option<&str>, steppable: bool) -> Self {
        let bin = server_bin();
        let dir = tempfile::Builder::new()
            .prefix("sidelock-pgcluster-")
            .tempdir()
            .expect("create cluster dir");
        let as_root = running_as_root();
        let data = dir.path().join("data");
        let sockets = dir.path().join("sockets");
        let log = dir.path().join("server.log");
        for path in [&data, &sockets] {
            std::fs::create_dir(path).expect("create cluster subdir");
        }
        std::fs::write(&log, "").expect("create server log");
        let pwfile = dir.path().join("pwfile");
        std::fs::write(&pwfile, password.unwrap_or_default()).expect("write the password file");
        let clock = steppable.then(|| {
            let file = dir.path().join("faketime.rc");
            std::fs::write(&file, "+0\n").expect("write the clock offset");
            file
        });
        if as_root {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
                .expect("chmod cluster dir");
            run_ok(
                Command::new("chown")
                    .args(["-R", "postgres:postgres"])
                    .arg(&data)
                    .arg(&sockets)
                    .arg(&log)
                    .arg(&pwfile)
                    .args(&clock),
                "chown the cluster dir to postgres",
            );
        }
        let port = free_port();
        let cluster = Self {
            bin,
            data,
            log,
            port,
            as_root,
            password: password.map(str::to_owned),
            clock,
            dir,
        };
        let mut initdb = cluster.command("initdb");
        initdb.args([
            "-U",
            "postgres",
            "--auth=trust",
            "--no-sync",
            "--encoding=UTF8",
            "--locale=C",
        ]);
        if password.is_some() {
            initdb
                .arg("--auth-host=scram-sha-256")
                .arg("--pwfile")
                .arg(&pwfile);
        }
        run_ok(initdb.arg("-D").arg(&cluster.data), "initdb");
        let listen = std::iter::once("127.0.0.1")
            .chain(addresses.iter().copied())
            .collect::<Vec<_>>()
            .join(",");
        if !addresses.is_empty() {
            let hba_path = cluster.data.join("pg_hba.conf");
            let mut hba = std::fs::read_to_string(&hba_path).expect("read pg_hba.conf");
            hba.push_str("\nhost all all 10.0.0.0/8 trust\n");
            std::fs::write(&hba_path, hba).expect("write pg_hba.conf");
        }
        let conf = format!(
            "\nport = {port}\nlisten_addresses = '{listen}'\nunix_socket_directories = '{}'\n\
             max_connections = 300\nfsync = off\nshared_preload_libraries = 'pg_stat_statements'\n\
             pg_stat_statements.track_utility = on\n",
            sockets.display()
        );
        let conf_path = cluster.data.join("postgresql.conf");
        let mut text = std::fs::read_to_string(&conf_path).expect("read postgresql.conf");
        text.push_str(&conf);
        std::fs::write(&conf_path, text).expect("write postgresql.conf");
        cluster.start_server();
        cluster
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// `postgres://postgres@127.0.0.1:PORT/DB` (`postgres:<password>@` when
    /// the cluster requires one).
    pub fn url(&self, database: &str) -> String {
        match &self.password {
            None => url(self.port, database),
            Some(p) => format!("postgres://postgres:{p}@{HOST}:{}/{database}", self.port),
        }
    }

    /// A client of `database` in this cluster.
    pub async fn client(&self, database: &str) -> Client {
        connect(&self.url(database))
            .await
            .unwrap_or_else(|e| panic!("connect to the test cluster: {e:?}\n{}", self.server_log()))
    }

    /// Starts the server (again) and waits until it accepts connections.
    pub fn start_server(&self) {
        let mut pg_ctl = match &self.clock {
            Some(file) => self.command_with(
                "pg_ctl",
                &[
                    ("LD_PRELOAD", faketime_library().as_os_str()),
                    ("FAKETIME_TIMESTAMP_FILE", file.as_os_str()),
                    ("FAKETIME_NO_CACHE", "1".as_ref()),
                    ("FAKETIME_DONT_FAKE_MONOTONIC", "1".as_ref()),
                ],
            ),
            None => self.command("pg_ctl"),
        };
        run_ok(
            pg_ctl
                .args(["-w", "-t", "60", "-l"])
                .arg(&self.log)
                .arg("-D")
                .arg(&self.data)
                .arg("start"),
            "pg_ctl start",
        );
    }

    /// Stops the server (`fast`: open transactions are rolled back, clients disconnected).
    pub fn stop_server(&self) {
        self.stop_with("fast");
    }

    /// Stops the server as a crash would (`immediate`: no checkpoint, WAL
    /// still in its buffers is lost, as are commits that did not wait for
    /// their flush).
    pub fn crash_server(&self) {
        self.stop_with("immediate");
    }

    fn stop_with(&self, mode: &str) {
        run_ok(
            self.command("pg_ctl")
                .args(["-w", "-t", "60", "-m", mode, "-D"])
                .arg(&self.data)
                .arg("stop"),
            &format!("pg_ctl stop -m {mode}"),
        );
    }

    pub fn server_log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn command(&self, program: &str) -> Command {
        self.command_with(program, &[])
    }

    /// As [`Self::command`], with `env` set for the program (through `env`
    /// when it runs as the `postgres` user).
    fn command_with(&self, program: &str, env: &[(&str, &std::ffi::OsStr)]) -> Command {
        let path = self.bin.join(program);
        if self.as_root && !env.is_empty() {
            let mut cmd = Command::new("runuser");
            cmd.args(["-u", "postgres", "--", "env"]);
            for (k, v) in env {
                let mut pair = std::ffi::OsString::from(format!("{k}="));
                pair.push(v);
                cmd.arg(pair);
            }
            cmd.arg(path).current_dir(self.dir.path());
            return cmd;
        }
        if !env.is_empty() {
            let mut cmd = Command::new(path);
            cmd.envs(env.iter().copied());
            return cmd;
        }
        if self.as_root {
            let mut cmd = Command::new("runuser");
            cmd.args(["-u", "postgres", "--"]).arg(path);
            // The server must not inherit the test's working directory permissions problems.
            cmd.current_dir(self.dir.path());
            cmd
        } else {
            Command::new(path)
        }
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        let _ = self
            .command("pg_ctl")
            .args(["-w", "-t", "30", "-m", "immediate", "-D"])
            .arg(&self.data)
            .arg("stop")
            .output();
        if std::thread::panicking() {
            eprintln!(
                "----- PostgreSQL test cluster log ({}) -----\n{}",
                self.log.display(),
                self.server_log()
            );
        }
    }
}

fn run_ok(cmd: &mut Command, what: &str) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot run {cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn running_as_root() -> bool {
    let out = run_ok(Command::new("id").arg("-u"), "id -u");
    String::from_utf8_lossy(&out.stdout).trim() == "0"
}
