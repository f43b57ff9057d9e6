//! `sidelock run … -- CMD` and `sidelock campaign … -- CMD` as child processes.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::{Command, ExitStatus};
use std::time::Duration;

use tempfile::TempDir;

use super::process::ChildGuard;
use super::sidecar::{SIDELOCK_BIN, remove_inherited_sidelock_env};
use super::{EVENT_TIMEOUT, eventually};

/// Flags and command for one `sidelock run`.
#[must_use]
pub struct RunBuilder {
    args: Vec<OsString>,
    env: Vec<(OsString, OsString)>,
    command: Vec<OsString>,
}

impl RunBuilder {
    /// `sidelock run --url <sidecar_url> --lock <lock>`.
    pub fn new(sidecar_url: &str, lock: &str) -> Self {
        Self {
            args: vec![
                "run".into(),
                "--url".into(),
                sidecar_url.into(),
                "--lock".into(),
                lock.into(),
            ],
            env: vec![("NO_COLOR".into(), "1".into())],
            command: Vec::new(),
        }
    }

    /// `sidelock campaign --url <sidecar_url> --name <election>`.
    pub fn campaign(sidecar_url: &str, election: &str) -> Self {
        Self {
            args: vec![
                "campaign".into(),
                "--url".into(),
                sidecar_url.into(),
                "--name".into(),
                election.into(),
            ],
            env: vec![("NO_COLOR".into(), "1".into())],
            command: Vec::new(),
        }
    }

    /// Appends `--<name> <value>` (before the `--`).
    pub fn flag(mut self, name: &str, value: &str) -> Self {
        self.args.push(format!("--{name}").into());
        self.args.push(value.into());
        self
    }

    /// Appends one raw argument (before the `--`), e.g. `--shared`.
    pub fn arg(mut self, arg: &str) -> Self {
        self.args.push(arg.into());
        self
    }

    pub fn wait(self, duration: &str) -> Self {
        self.flag("wait", duration)
    }

    pub fn env(mut self, key: &str, value: &str) -> Self {
        self.env.push((key.into(), value.into()));
        self
    }

    /// The command is `sh -c <script>`, run in the guard's temp directory
    /// (so the script can write marker files with relative paths).
    pub fn sh(mut self, script: &str) -> Self {
        self.command = vec!["sh".into(), "-c".into(), script.into()];
        self
    }

    pub fn spawn(self) -> RunGuard {
        assert!(!self.command.is_empty(), "RunBuilder needs a command");
        let dir = tempfile::Builder::new()
            .prefix("sidelock-run-")
            .tempdir()
            .expect("create temp dir");
        let mut cmd = Command::new(SIDELOCK_BIN);
        cmd.current_dir(dir.path());
        remove_inherited_sidelock_env(&mut cmd);
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
        cmd.args(&self.args).arg("--").args(&self.command);
        let log_path = dir.path().join("run.log");
        // Its own process group, so that dropping the guard also kills CMD.
        let child = ChildGuard::spawn(cmd, "sidelock run", &log_path, true);
        RunGuard { child, dir }
    }
}

/// A running `sidelock run`; its whole process group is SIGKILLed on drop.
pub struct RunGuard {
    // Dropped before `dir`, so the log still exists when it is printed.
    child: ChildGuard,
    dir: TempDir,
}

impl RunGuard {
    /// A file in [`RunGuard::dir`].
    pub fn file(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn log(&self) -> String {
        self.child.log()
    }

    /// Sends `signal` to the sidelock process alone (not to CMD).
    pub fn signal(&self, signal: nix::sys::signal::Signal) {
        self.child.signal(signal);
    }

    pub async fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        self.child.wait_exit(timeout).await
    }

    /// Waits for the exit and returns the exit code (panics if it was killed
    /// by a signal).
    pub async fn exit_code(&mut self, timeout: Duration) -> i32 {
        let status = self.wait_exit(timeout).await;
        status.code().unwrap_or_else(|| {
            panic!(
                "sidelock run was killed ({status}); log:\n{}",
                self.child.log()
            )
        })
    }

    /// Waits until CMD has created the file `name`.
    pub async fn wait_for_file(&mut self, name: &str) {
        let path = self.file(name);
        eventually(
            &format!("CMD to create {}", path.display()),
            EVENT_TIMEOUT,
            async || {
                if let Some(status) = self.child.try_status() {
                    panic!("sidelock run exited ({status}) before CMD created {name}");
                }
                path.exists().then_some(())
            },
        )
        .await;
    }
}
