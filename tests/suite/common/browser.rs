//! Headless Chromium driven over WebDriver (chromedriver + fantoccini).
//!
//! [`Browser::start`] runs `chromedriver` on a free port in its own process
//! group (killed with everything it started when the guard drops) and opens
//! a session with a fresh profile. Chromium and chromedriver are Debian's
//! `chromium` and `chromium-driver`; when either is missing the test fails
//! and says to run `scripts/setup.sh`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use fantoccini::{Client, ClientBuilder, Locator};
use hyper_util::client::legacy::connect::HttpConnector;
use serde_json::{Value, json};
use tempfile::TempDir;

use super::POLL_INTERVAL;
use super::free_port;
use super::process::ChildGuard;

/// How long to wait for chromedriver to answer `/status`.
const DRIVER_START: Duration = Duration::from_secs(20);
/// Default deadline for something to show up on the page.
pub const PAGE_TIMEOUT: Duration = Duration::from_secs(15);

const CHROMIUM_FLAGS: &[&str] = &[
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--hide-scrollbars",
    "--force-device-scale-factor=1",
];

/// The first of `names` found on `PATH` (or the path in `env`, if set).
fn find_program(env: &str, names: &[&str]) -> Option<PathBuf> {
    if let Some(path) = std::env::var_os(env).map(PathBuf::from) {
        return path.is_file().then_some(path);
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .flat_map(|dir| names.iter().map(move |n| dir.join(n)))
        .find(|p| p.is_file())
}

/// A WebDriver session in headless Chromium.
pub struct Browser {
    pub client: Client,
    // Dropped after the client: killing the driver's group ends Chromium too.
    _driver: ChildGuard,
    _profile: TempDir,
}

impl Browser {
    /// Starts chromedriver and a Chromium session with a `width`×`height` window.
    pub async fn start(width: u32, height: u32) -> Browser {
        let chromium = find_program(
            "CHROME_BIN",
            &["chromium", "chromium-browser", "google-chrome"],
        )
        .unwrap_or_else(|| {
            panic!(
                "Chromium is not installed (looked for chromium on PATH and $CHROME_BIN): \
                     run scripts/setup.sh, which installs Debian's chromium and chromium-driver"
            )
        });
        let chromedriver = find_program("CHROMEDRIVER", &["chromedriver"]).unwrap_or_else(|| {
            panic!(
                "chromedriver is not installed (looked on PATH and $CHROMEDRIVER): \
                 run scripts/setup.sh, which installs Debian's chromium-driver"
            )
        });
        let profile = tempfile::Builder::new()
            .prefix("sidelock-chromium-")
            .tempdir()
            .expect("create a Chromium profile dir");
        let port = free_port();
        let mut cmd = Command::new(&chromedriver);
        cmd.arg(format!("--port={port}"))
            .arg("--allowed-ips=127.0.0.1");
        let log = profile.path().join("chromedriver.log");
        let driver = ChildGuard::spawn(cmd, "chromedriver", &log, true);
        let url = format!("http://127.0.0.1:{port}");
        wait_until_ready(&url).await;

        let mut args: Vec<String> = CHROMIUM_FLAGS.iter().map(|s| (*s).to_owned()).collect();
        args.push(format!(
            "--user-data-dir={}",
            profile.path().join("profile").display()
        ));
        args.push(format!("--window-size={width},{height}"));
        let caps = json!({
            "goog:chromeOptions": { "binary": chromium, "args": args },
            "pageLoadStrategy": "normal",
        });
        let caps = match caps {
            Value::Object(map) => map,
            _ => unreachable!(),
        };
        let client = ClientBuilder::new(HttpConnector::new())
            .capabilities(caps)
            .connect(&url)
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "start a Chromium session through {} with {}: {e}\n(run scripts/setup.sh if Chromium is missing or broken)",
                    chromedriver.display(),
                    chromium.display()
                )
            });
        Browser {
            client,
            _driver: driver,
            _profile: profile,
        }
    }

    /// Runs `script` (a function body; `arguments[i]` are `args`) and returns its value.
    pub async fn js(&self, script: &str, args: Vec<Value>) -> Value {
        self.client
            .execute(script, args)
            .await
            .unwrap_or_else(|e| panic!("execute {script:?}: {e}"))
    }

    /// Polls `script` until it returns `true`, failing with `what` (and the
    /// text of the page) after `timeout`.
    pub async fn wait_for(&self, what: &str, timeout: Duration, script: &str, args: Vec<Value>) {
        let deadline = Instant::now() + timeout;
        loop {
            if self.js(script, args.clone()).await == Value::Bool(true) {
                return;
            }
            if Instant::now() > deadline {
                let text = self.js("return document.body.innerText", vec![]).await;
                panic!(
                    "timed out after {timeout:?} waiting for {what}; the page says:\n{}",
                    text.as_str().unwrap_or_default()
                );
            }
            tokio::time::sleep(POLL_INTERVAL * 10).await;
        }
    }

    /// Waits until the text of the element `selector` contains `text`.
    pub async fn wait_for_text(&self, selector: &str, text: &str) {
        self.wait_for(
            &format!("{selector} to contain {text:?}"),
            PAGE_TIMEOUT,
            "const el = document.querySelector(arguments[0]); return !!el && el.textContent.includes(arguments[1]);",
            vec![json!(selector), json!(text)],
        )
        .await;
    }

    /// Waits until the text of the element `selector` no longer contains `text`.
    pub async fn wait_for_no_text(&self, selector: &str, text: &str) {
        self.wait_for(
            &format!("{selector} to stop containing {text:?}"),
            PAGE_TIMEOUT,
            "const el = document.querySelector(arguments[0]); return !!el && !el.textContent.includes(arguments[1]);",
            vec![json!(selector), json!(text)],
        )
        .await;
    }

    /// Clicks the element `selector` (retrying while a live refresh replaces it).
    pub async fn click(&self, selector: &str) {
        let deadline = Instant::now() + PAGE_TIMEOUT;
        loop {
            let clicked = match self.client.find(Locator::Css(selector)).await {
                Ok(el) => el.click().await,
                Err(e) => Err(e),
            };
            match clicked {
                Ok(()) => return,
                Err(e) if Instant::now() > deadline => panic!("click {selector}: {e}"),
                Err(_) => tokio::time::sleep(POLL_INTERVAL * 5).await,
            }
        }
    }

    /// Types `text` into the element `selector`.
    pub async fn type_into(&self, selector: &str, text: &str) {
        let el = self
            .client
            .find(Locator::Css(selector))
            .await
            .unwrap_or_else(|e| panic!("find {selector}: {e}"));
        el.clear()
            .await
            .unwrap_or_else(|e| panic!("clear {selector}: {e}"));
        el.send_keys(text)
            .await
            .unwrap_or_else(|e| panic!("type into {selector}: {e}"));
    }

    /// Saves a PNG of the viewport to `path`.
    pub async fn screenshot(&self, path: &Path) {
        let png = self
            .client
            .screenshot()
            .await
            .unwrap_or_else(|e| panic!("take a screenshot: {e}"));
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).expect("create the screenshot directory");
        }
        std::fs::write(path, png).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
    }

    /// Saves a PNG of the whole page to `path`: the window grows to the
    /// page's height for the shot and shrinks back afterwards.
    pub async fn full_page_screenshot(&self, path: &Path) {
        let (width, height) = self
            .client
            .get_window_size()
            .await
            .expect("read the window size");
        let inner = self.js("return window.innerHeight;", vec![]).await;
        let chrome = height.saturating_sub(inner.as_u64().unwrap_or(height));
        let page = self
            .js("return document.documentElement.scrollHeight;", vec![])
            .await
            .as_u64()
            .unwrap_or(height);
        let tall = u32::try_from(page + chrome).unwrap_or(u32::MAX);
        let width = u32::try_from(width).unwrap_or(1280);
        self.client
            .set_window_size(width, tall)
            .await
            .expect("grow the window");
        tokio::time::sleep(Duration::from_millis(250)).await;
        self.screenshot(path).await;
        self.client
            .set_window_size(width, u32::try_from(height).unwrap_or(900))
            .await
            .expect("shrink the window");
    }

    /// Ends the session (Chromium quits) and stops chromedriver.
    pub async fn close(self) {
        let _ = self.client.clone().close().await;
    }
}

async fn wait_until_ready(url: &str) {
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(2))
        .build()
        .expect("build HTTP client");
    let deadline = Instant::now() + DRIVER_START;
    loop {
        if let Ok(response) = http.get(format!("{url}/status")).send().await
            && let Ok(status) = response.json::<Value>().await
            && status["value"]["ready"] == Value::Bool(true)
        {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "chromedriver did not become ready at {url} within {DRIVER_START:?}"
        );
        tokio::time::sleep(POLL_INTERVAL * 5).await;
    }
}
