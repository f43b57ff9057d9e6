//! A child process that is always reaped: killed on drop, its combined
//! stdout/stderr kept in a log file that is printed when the test panics.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{Signal, kill, killpg};
use nix::unistd::Pid;

use crate::POLL_INTERVAL;

pub struct ChildGuard {
    child: Child,
    label: String,
    log_path: PathBuf,
    /// The child leads its own process group, killed as a whole on drop
    /// (used for `sidelock run`, whose CMD must not outlive the test).
    own_group: bool,
    status: Option<ExitStatus>,
}

impl ChildGuard {
    /// Spawns `cmd` with stdin closed and stdout + stderr appended to
    /// `log_path`.
    pub fn spawn(mut cmd: Command, label: &str, log_path: &Path, own_group: bool) -> Self {
        let log = File::create(log_path)
            .unwrap_or_else(|e| panic!("create log file {}: {e}", log_path.display()));
        let log_err = log.try_clone().expect("clone log file handle");
        cmd.stdin(Stdio::null()).stdout(log).stderr(log_err);
        if own_group {
            cmd.process_group(0);
        }
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {label} ({cmd:?}): {e}"));
        Self {
            child,
            label: label.to_owned(),
            log_path: log_path.to_owned(),
            own_group,
            status: None,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Everything the process has written to stdout and stderr so far.
    pub fn log(&self) -> String {
        std::fs::read(&self.log_path)
            .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
            .unwrap_or_else(|e| format!("<cannot read {}: {e}>", self.log_path.display()))
    }

    /// Sends `signal` to the process (not to its group).
    pub fn signal(&self, signal: Signal) {
        let pid = Pid::from_raw(i32::try_from(self.pid()).expect("pid fits in i32"));
        kill(pid, signal).unwrap_or_else(|e| panic!("send {signal} to {}: {e}", self.label));
    }

    /// The exit status if the process has exited (it is reaped then).
    pub fn try_status(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self
                .child
                .try_wait()
                .unwrap_or_else(|e| panic!("wait for {}: {e}", self.label));
        }
        self.status
    }

    /// Waits for the process to exit, panicking (with its log) after `timeout`.
    pub async fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_status() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "{} did not exit within {timeout:?}; log:\n{}",
                self.label,
                self.log()
            );
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }

    pub fn label(&self) -> &str {
        &self.label
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if self.try_status().is_none() {
            // Only while the child is unreaped is its pid (and group id)
            // guaranteed to still be ours.
            if self.own_group {
                let pgid = Pid::from_raw(i32::try_from(self.child.id()).unwrap_or(0));
                let _ = killpg(pgid, Signal::SIGKILL);
            } else {
                let _ = self.child.kill();
            }
            self.status = self.child.wait().ok();
        }
        if std::thread::panicking() {
            eprintln!(
                "----- {} (pid {}, {:?}) log {} -----\n{}\n----- end of {} log -----",
                self.label,
                self.child.id(),
                self.status,
                self.log_path.display(),
                self.log(),
                self.label
            );
        }
    }
}
