//! What the dashboard shows, gathered from the core and formatted for the
//! templates. Every string here is data: the templates escape it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::StreamExt;

use crate::backend::Safety;
use crate::core::election::ElectionView;
use crate::error::Error;
use crate::http::App;
use crate::lock::{Kind, LockKey, Name};

use super::chart::{Charts, charts};
use super::format::{fmt_duration_ms, fmt_latency_ms, fmt_rate, fmt_utc};
use super::stats::{Recent, StatsView};

/// Locks per page unless `limit` says otherwise.
pub const DEFAULT_LIMIT: usize = 50;
/// Largest page.
pub const MAX_LIMIT: usize = 500;
/// Page sizes offered in the filter form.
pub const LIMITS: [usize; 4] = [25, 50, 100, 200];
/// How long the header's backend ping may take.
pub const PING_TIMEOUT: Duration = Duration::from_millis(1500);
/// Inspections run at once while building a page.
const INSPECT_CONCURRENCY: usize = 16;
/// A TTL below this is highlighted.
const TTL_WARN_MS: u64 = 5_000;

/// The query string of the page and its live fragment (all optional, all
/// checked here so that a bad value shows a message instead of an error page).
#[derive(Debug, Default, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PageQuery {
    pub prefix: Option<String>,
    pub cursor: Option<String>,
    pub limit: Option<String>,
    pub page: Option<String>,
    /// Set when the query string could not be read (a parameter unknown
    /// or given twice): the page then shows why, unfiltered.
    #[serde(skip)]
    pub unreadable: bool,
}

/// The backend's health at render time.
#[derive(Debug, Clone)]
pub struct Health {
    pub ok: bool,
    /// `healthy`, `unreachable`, `no answer`, `shutting down`.
    pub label: String,
    pub detail: String,
    /// Ready in the sense of `/readyz`.
    pub ready: bool,
    /// While the backend cannot be reached: which one and why, for the
    /// banner (`redis redis://10.0.0.5:6379/0: connection refused`).
    pub outage: Option<String>,
}

/// The filter and page position.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    pub prefix: String,
    pub limit: usize,
    pub page: u32,
    pub cursor: Option<String>,
    /// Why the filter could not be applied.
    pub error: Option<String>,
}

impl Filter {
    /// Reads the query, falling back to defaults with a message.
    pub fn parse(q: &PageQuery) -> Filter {
        let mut f = Filter {
            prefix: q.prefix.clone().unwrap_or_default().trim().to_owned(),
            limit: DEFAULT_LIMIT,
            page: 1,
            cursor: q.cursor.clone().filter(|c| !c.is_empty()),
            error: None,
        };
        if let Some(limit) = q.limit.as_deref().filter(|l| !l.is_empty()) {
            match limit.parse::<usize>() {
                Ok(n) if (1..=MAX_LIMIT).contains(&n) => f.limit = n,
                _ => f.error = Some(format!("page size must be 1 to {MAX_LIMIT}")),
            }
        }
        if let Some(page) = q.page.as_deref().filter(|p| !p.is_empty()) {
            match page.parse::<u32>() {
                Ok(page) => f.page = page.max(1),
                Err(_) => f.error = Some("page must be a whole number from 1".into()),
            }
        }
        if q.unreadable {
            f.error = Some(
                "the query string takes prefix, limit, cursor and page, each at most once".into(),
            );
        }
        if f.cursor.is_none() {
            f.page = 1;
        }
        if !f.prefix.is_empty()
            && let Err(e) = Name::parse(&f.prefix)
        {
            f.error = Some(format!(
                "prefix: {}",
                e.replacen("lock name", "a lock name prefix", 1)
            ));
        }
        f
    }

    /// The query string for a page of this filter.
    pub fn href(&self, cursor: Option<&str>, page: u32) -> String {
        let mut q = url::form_urlencoded::Serializer::new(String::new());
        if !self.prefix.is_empty() {
            q.append_pair("prefix", &self.prefix);
        }
        if self.limit != DEFAULT_LIMIT {
            q.append_pair("limit", &self.limit.to_string());
        }
        if let Some(c) = cursor {
            q.append_pair("cursor", c);
            q.append_pair("page", &page.to_string());
        }
        let q = q.finish();
        if q.is_empty() {
            "/".into()
        } else {
            format!("/?{q}")
        }
    }

    /// The page size when `limit` is not given.
    pub fn default_limit(&self) -> usize {
        DEFAULT_LIMIT
    }

    /// `(value, selected)` for the page-size menu.
    pub fn limit_options(&self) -> Vec<(usize, bool)> {
        let mut all: Vec<usize> = LIMITS.to_vec();
        if !all.contains(&self.limit) {
            all.push(self.limit);
            all.sort_unstable();
        }
        all.into_iter().map(|l| (l, l == self.limit)).collect()
    }
}

/// One holder row.
#[derive(Debug, Clone)]
pub struct HolderRow {
    pub owner: String,
    pub sidecar: String,
    /// Held through this sidecar.
    pub here: bool,
    pub mode: &'static str,
    pub since_ms: u64,
    pub since_utc: String,
    /// `07:45:52 UTC`: the time of day the lease was granted.
    pub since_clock: String,
    pub held_for: String,
    /// Held longer than `--stale-after`.
    pub long: bool,
    pub expires_at_ms: u64,
    pub ttl_left: String,
    /// `ok`, `warn` (under 5 s) or `over` (past expiry, not yet cleaned up).
    pub ttl_state: &'static str,
    pub fence: u64,
    pub count: u32,
}

/// One waiter, in queue order.
#[derive(Debug, Clone)]
pub struct WaiterRow {
    pub position: usize,
    pub owner: String,
    pub sidecar: String,
    pub here: bool,
    pub mode: &'static str,
    pub since_ms: u64,
    pub waited: String,
}

/// One lock or semaphore on the page.
#[derive(Debug, Clone)]
pub struct LockGroup {
    pub name: String,
    /// `lock` or `semaphore`.
    pub kind: &'static str,
    /// `locks` or `semaphores` (API path segment).
    pub path: &'static str,
    pub limit: Option<u32>,
    pub holders: Vec<HolderRow>,
    pub waiters: Vec<WaiterRow>,
}

impl LockGroup {
    /// Owners of the current holders, for the queue cards.
    pub fn holder_summary(&self) -> String {
        match self.holders.len() {
            0 => "nobody holds it (lock-delay or a grant in flight)".into(),
            1 => format!("held by {}", self.holders[0].owner),
            n => format!("{n} holders"),
        }
    }
}

/// One election on the page.
#[derive(Debug, Clone)]
pub struct ElectionRow {
    pub name: String,
    /// The leader's owner, value and sidecar; `None` while nobody leads.
    pub leader: Option<(String, Option<String>, String)>,
    /// The leader's campaign runs through this sidecar.
    pub here: bool,
    pub since_ms: u64,
    pub since_utc: String,
    /// `07:45:52 UTC`: when the leadership began.
    pub since_clock: String,
    pub led_for: String,
    pub fence: u64,
    pub candidates: usize,
}

/// One stale key.
#[derive(Debug, Clone)]
pub struct StaleRow {
    pub key: String,
    pub reason: String,
    pub since_ms: u64,
    pub age: String,
    pub detail: String,
}

/// The summary tiles.
#[derive(Debug, Clone, Default)]
pub struct Tiles {
    /// `None` (shown as unknown) when the backend could not be listed.
    pub locks: Option<usize>,
    pub holders: Option<usize>,
    pub waiters: Option<usize>,
    /// The count, with a `+` when the list was cut.
    pub stale: Option<String>,
    pub rate: String,
    pub refused: u64,
    pub wait_p99: String,
}

/// Everything the page shows.
#[derive(Debug, Clone)]
pub struct View {
    pub now_ms: u64,
    pub sidecar: String,
    pub version: &'static str,
    pub backend_url: String,
    pub safety: &'static str,
    pub safety_note: &'static str,
    pub started_at_ms: u64,
    pub started_utc: String,
    pub uptime: String,
    pub health: Health,
    pub held_here: usize,
    pub waiting_here: usize,
    pub api_token_required: bool,
    pub admin_enabled: bool,
    pub filter: Filter,
    pub locks: Vec<LockGroup>,
    /// The elections on the page (their keys are listed with the locks).
    pub elections: Vec<ElectionRow>,
    pub list_error: Option<String>,
    pub next_href: Option<String>,
    pub first_href: Option<String>,
    pub stale: Vec<StaleRow>,
    /// The scan found more stale keys than [`View::stale`] holds.
    pub stale_truncated: bool,
    pub stale_error: Option<String>,
    pub tiles: Tiles,
    pub charts: Charts,
}

impl View {
    /// Whether any lock on the page has holders.
    pub fn any_holders(&self) -> bool {
        self.locks.iter().any(|l| !l.holders.is_empty())
    }

    /// The locks on the page with holders, for the holders table: those
    /// with a queue first (in page order), so a queue shows without scrolling.
    pub fn held_locks(&self) -> Vec<&LockGroup> {
        let mut held: Vec<&LockGroup> = self
            .locks
            .iter()
            .filter(|l| !l.holders.is_empty())
            .collect();
        held.sort_by_key(|l| l.waiters.is_empty());
        held
    }

    /// The locks on the page with waiters.
    pub fn queues(&self) -> Vec<&LockGroup> {
        self.locks
            .iter()
            .filter(|l| !l.waiters.is_empty())
            .collect()
    }

    /// When the page was rendered.
    pub fn rendered_utc(&self) -> String {
        fmt_utc(self.now_ms)
    }

    /// The link to this page's data as JSON, for scripts.
    pub fn json_href(&self) -> String {
        let mut q = url::form_urlencoded::Serializer::new(String::new());
        if !self.filter.prefix.is_empty() {
            q.append_pair("prefix", &self.filter.prefix);
        }
        q.append_pair("limit", &self.filter.limit.min(1000).to_string());
        if let Some(c) = &self.filter.cursor {
            q.append_pair("cursor", c);
        }
        format!("/v1/locks?{}", q.finish())
    }
}

/// Facts about the sidecar that do not need the backend.
pub struct Identity {
    pub sidecar: String,
    pub backend_url: String,
    pub safety: Safety,
    pub started_at_ms: u64,
    pub held_here: usize,
    pub waiting_here: usize,
    pub api_token_required: bool,
    pub admin_enabled: bool,
    pub stale_after: Duration,
}

/// What the backend answered.
pub struct Listing {
    /// `(key, state)` of each lock on the page.
    pub locks: Vec<(LockKey, crate::backend::State)>,
    pub next_cursor: Option<String>,
    pub error: Option<String>,
}

/// Gathers a page from the running sidecar.
pub async fn gather(
    app: &Arc<App>,
    dashboard: &crate::dashboard::Dashboard,
    q: &PageQuery,
) -> View {
    let core = &app.core;
    let description = core.backend().describe();
    let identity = Identity {
        sidecar: core.sidecar.clone(),
        backend_url: description.url,
        safety: description.safety,
        started_at_ms: app.started_at_ms,
        held_here: core.held(),
        waiting_here: core.waiting(),
        api_token_required: app.settings.api_token.is_some(),
        admin_enabled: app.settings.admin_token.is_some(),
        stale_after: core.limits.stale_after,
    };
    let filter = Filter::parse(q);
    let (health, listing, stale) = tokio::join!(
        health(app),
        listing(app, &filter),
        dashboard.stale(&app.core)
    );
    let stats = dashboard.stats.view(&core.metrics);
    let minute = dashboard.stats.recent(&core.metrics, 60_000);
    let five = dashboard.stats.recent(&core.metrics, 300_000);
    build(
        identity, filter, health, listing, stale, &stats, &minute, &five,
    )
}

async fn health(app: &App) -> Health {
    if app.core.shutdown.is_cancelled() {
        return Health {
            ok: false,
            label: "shutting down".into(),
            detail: "SIGTERM received: releasing leases and refusing new ones".into(),
            ready: false,
            outage: None,
        };
    }
    let started = Instant::now();
    match tokio::time::timeout(PING_TIMEOUT, app.core.ping()).await {
        Ok(Ok(())) => Health {
            ok: true,
            label: "healthy".into(),
            detail: format!(
                "answered a ping in {}",
                fmt_latency_ms(started.elapsed().as_secs_f64() * 1000.0)
            ),
            ready: true,
            outage: None,
        },
        Ok(Err(Error::Unavailable {
            backend: Some(b),
            cause,
            ..
        })) => Health {
            ok: false,
            label: "unreachable".into(),
            detail: format!("{cause}; the sidecar log has the outage"),
            ready: false,
            outage: Some(format!("{} {}: {cause}", b.kind, b.url)),
        },
        Ok(Err(e)) => Health {
            ok: false,
            label: "unreachable".into(),
            detail: format!("{e}; the sidecar log has the outage"),
            ready: false,
            outage: Some(e.to_string()),
        },
        Err(_) => Health {
            ok: false,
            label: "no answer".into(),
            detail: format!(
                "the backend did not answer a ping within {}",
                fmt_duration_ms(PING_TIMEOUT.as_millis() as u64)
            ),
            ready: false,
            outage: Some(format!(
                "{}: no answer within {}",
                app.core.backend().describe().url,
                fmt_duration_ms(PING_TIMEOUT.as_millis() as u64)
            )),
        },
    }
}

async fn listing(app: &App, filter: &Filter) -> Listing {
    let empty = |error: Option<String>| Listing {
        locks: Vec::new(),
        next_cursor: None,
        error,
    };
    if filter.error.is_some() {
        return empty(None);
    }
    let after = match filter.cursor.as_deref().map(LockKey::parse) {
        None => None,
        Some(Some(key)) => Some(key),
        Some(None) => {
            return empty(Some(
                "the page cursor is not valid; start from the first page".into(),
            ));
        }
    };
    let rows = match app
        .core
        .list(&filter.prefix, after.as_ref(), filter.limit)
        .await
    {
        Ok(rows) => rows,
        Err(e) => return empty(Some(format!("listing failed: {e}"))),
    };
    let next_cursor = (rows.len() == filter.limit)
        .then(|| rows.last().map(|r| r.key.to_string()))
        .flatten();
    let core = &app.core;
    let inspected: Vec<_> = futures::stream::iter(rows)
        .map(|row| async move {
            let state = core.inspect(&row.key).await;
            (row.key, state)
        })
        .buffered(INSPECT_CONCURRENCY)
        .collect()
        .await;
    let mut locks = Vec::with_capacity(inspected.len());
    let mut error = None;
    for (key, state) in inspected {
        match state {
            Ok(state) => locks.push((key, state)),
            Err(e) => error = Some(format!("inspecting {key} failed: {e}")),
        }
    }
    Listing {
        locks,
        next_cursor,
        error,
    }
}

/// Builds the view from gathered facts (no I/O; the rendering tests use it directly).
#[allow(clippy::too_many_arguments)]
pub fn build(
    id: Identity,
    filter: Filter,
    health: Health,
    listing: Listing,
    stale: super::StaleShown,
    stats: &StatsView,
    minute: &Recent,
    five: &Recent,
) -> View {
    let now = stats.now_ms.max(1);
    let stale_after_ms = id.stale_after.as_millis() as u64;
    let (elections, locks): (Vec<_>, Vec<_>) = listing
        .locks
        .into_iter()
        .partition(|(key, _)| key.kind == Kind::Election);
    let elections: Vec<ElectionRow> = elections
        .into_iter()
        .map(|(key, state)| {
            let view = ElectionView::of(&state);
            let since_ms = view.leader.as_ref().map_or(0, |l| l.since_ms);
            ElectionRow {
                name: key.name.to_string(),
                here: view
                    .leader
                    .as_ref()
                    .is_some_and(|l| l.sidecar == id.sidecar),
                fence: view.leader.as_ref().map_or(state.fence, |l| l.fence),
                leader: view.leader.map(|l| (l.owner, l.value, l.sidecar)),
                since_ms,
                since_utc: fmt_utc(since_ms),
                since_clock: fmt_utc(since_ms)[11..].to_owned(),
                led_for: fmt_duration_ms(now.saturating_sub(since_ms)),
                candidates: view.candidates,
            }
        })
        .collect();
    let locks: Vec<LockGroup> = locks
        .into_iter()
        .map(|(key, state)| {
            let holders = state
                .holders
                .into_iter()
                .map(|h| {
                    let held = now.saturating_sub(h.since_ms);
                    let left = h.expires_at_ms.saturating_sub(now);
                    HolderRow {
                        here: h.sidecar == id.sidecar,
                        owner: h.owner,
                        sidecar: h.sidecar,
                        mode: h.mode.as_str(),
                        since_ms: h.since_ms,
                        since_utc: fmt_utc(h.since_ms),
                        since_clock: fmt_utc(h.since_ms)[11..].to_owned(),
                        held_for: fmt_duration_ms(held),
                        long: held > stale_after_ms,
                        expires_at_ms: h.expires_at_ms,
                        ttl_left: if h.expires_at_ms <= now {
                            "expired".into()
                        } else {
                            fmt_duration_ms(left)
                        },
                        ttl_state: if h.expires_at_ms <= now {
                            "over"
                        } else if left < TTL_WARN_MS {
                            "warn"
                        } else {
                            "ok"
                        },
                        fence: h.fence,
                        count: h.count,
                    }
                })
                .collect();
            let mut waiters: Vec<WaiterRow> = state
                .waiters
                .into_iter()
                .map(|w| WaiterRow {
                    position: w.position,
                    here: w.sidecar == id.sidecar,
                    owner: w.owner,
                    sidecar: w.sidecar,
                    mode: w.mode.as_str(),
                    since_ms: w.since_ms,
                    waited: fmt_duration_ms(now.saturating_sub(w.since_ms)),
                })
                .collect();
            waiters.sort_by_key(|w| w.position);
            LockGroup {
                name: key.name.to_string(),
                kind: key.kind.as_str(),
                path: key.kind.plural(),
                limit: state.limit,
                holders,
                waiters,
            }
        })
        .collect();
    let (stale, stale_truncated, stale_error) = match stale {
        Ok((list, truncated)) => (
            list.into_iter()
                .map(|s| StaleRow {
                    since_ms: now.saturating_sub(s.age_ms),
                    age: fmt_duration_ms(s.age_ms),
                    key: s.key,
                    reason: s.reason.as_str().to_owned(),
                    detail: s.detail,
                })
                .collect(),
            truncated,
            None,
        ),
        Err(e) => (Vec::new(), false, Some(e)),
    };
    let listed = listing.error.is_none();
    let tiles = Tiles {
        locks: listed.then_some(locks.len()),
        holders: listed.then(|| locks.iter().map(|l| l.holders.len()).sum()),
        waiters: listed.then(|| locks.iter().map(|l| l.waiters.len()).sum()),
        stale: stale_error
            .is_none()
            .then(|| format!("{}{}", stale.len(), if stale_truncated { "+" } else { "" })),
        rate: fmt_rate(minute.granted_per_second),
        refused: minute.refused,
        wait_p99: five
            .wait_p99_ms
            .map_or_else(|| "–".to_owned(), fmt_latency_ms),
    };
    let next_href = listing
        .next_cursor
        .as_deref()
        .map(|c| filter.href(Some(c), filter.page.saturating_add(1)));
    let first_href = filter.cursor.is_some().then(|| filter.href(None, 1));
    let (safety, safety_note) = match id.safety {
        Safety::SingleProcess => (
            "single-process",
            "locks exist inside this one sidecar only (development and tests)",
        ),
        Safety::Efficiency => (
            "efficiency",
            "good for avoiding duplicate work; a failover or clock jump can break exclusion — use fences",
        ),
        Safety::Correctness => (
            "correctness",
            "exclusion holds through failures; fences make writes safe",
        ),
    };
    View {
        now_ms: now,
        sidecar: id.sidecar,
        version: env!("CARGO_PKG_VERSION"),
        backend_url: id.backend_url,
        safety,
        safety_note,
        started_at_ms: id.started_at_ms,
        started_utc: fmt_utc(id.started_at_ms),
        uptime: fmt_duration_ms(now.saturating_sub(id.started_at_ms)),
        health,
        held_here: id.held_here,
        waiting_here: id.waiting_here,
        api_token_required: id.api_token_required,
        admin_enabled: id.admin_enabled,
        filter,
        locks,
        elections,
        list_error: listing.error,
        next_href,
        first_href,
        stale,
        stale_truncated,
        stale_error,
        tiles,
        charts: charts(stats, five),
    }
}

#[cfg(test)]
mod tests {
    use super::super::chart::nice_ceiling;
    use super::*;

    #[test]
    fn durations_read_like_an_operator_expects() {
        assert_eq!(fmt_duration_ms(0), "0 ms");
        assert_eq!(fmt_duration_ms(850), "850 ms");
        assert_eq!(fmt_duration_ms(12_400), "12 s");
        assert_eq!(fmt_duration_ms(123_000), "2m 03s");
        assert_eq!(fmt_duration_ms(3_720_000), "1h 02m");
        assert_eq!(fmt_duration_ms(273_600_000), "3d 04h");
        assert_eq!(fmt_latency_ms(0.04), "< 0.1 ms");
        assert_eq!(fmt_latency_ms(0.25), "0.25 ms");
        assert_eq!(fmt_latency_ms(3.21), "3.2 ms");
        assert_eq!(fmt_latency_ms(45.4), "45 ms");
        assert_eq!(fmt_latency_ms(1300.0), "1.3 s");
        assert_eq!(fmt_latency_ms(125_000.0), "2m 05s");
        assert_eq!(fmt_rate(0.0), "0");
        assert_eq!(fmt_rate(0.45), "0.5");
        assert_eq!(fmt_rate(2.0), "2");
        assert_eq!(fmt_rate(123.4), "123");
        assert_eq!(fmt_rate(1234.0), "1.2k");
    }

    #[test]
    fn utc_dates() {
        assert_eq!(fmt_utc(0), "1970-01-01 00:00:00 UTC");
        assert_eq!(fmt_utc(951_782_400_000), "2000-02-29 00:00:00 UTC");
        assert_eq!(fmt_utc(1_795_246_486_004), "2026-11-21 07:34:46 UTC");
        // Past year 9999 (a time written into the backend by hand): shown
        // as its last second, not a panic of the page's handler.
        assert_eq!(fmt_utc(u64::MAX), "9999-12-31 23:59:59 UTC");
        assert_eq!(fmt_utc(253_402_300_800_000), "9999-12-31 23:59:59 UTC");
    }

    #[test]
    fn nice_ceilings() {
        assert_eq!(nice_ceiling(0.0), 1.0);
        assert_eq!(nice_ceiling(1.5), 2.0);
        assert_eq!(nice_ceiling(3.0), 5.0);
        assert_eq!(nice_ceiling(7.0), 10.0);
        assert_eq!(nice_ceiling(120.0), 200.0);
    }

    #[test]
    fn filter_checks_its_input() {
        let f = Filter::parse(&PageQuery {
            prefix: Some("bad prefix!".into()),
            limit: Some("9999".into()),
            ..Default::default()
        });
        assert!(f.error.is_some());
        let f = Filter::parse(&PageQuery {
            prefix: Some("billing:".into()),
            limit: Some("100".into()),
            cursor: Some("locks/billing:x".into()),
            page: Some("3".into()),
            unreadable: false,
        });
        assert_eq!(f.error, None);
        assert_eq!((f.limit, f.page), (100, 3));
        assert_eq!(
            f.href(Some("locks/billing:y"), 4),
            "/?prefix=billing%3A&limit=100&cursor=locks%2Fbilling%3Ay&page=4"
        );
        assert_eq!(f.href(None, 1), "/?prefix=billing%3A&limit=100");
        assert_eq!(Filter::parse(&PageQuery::default()).href(None, 1), "/");
        for unread in ["prefix=a&prefix=b", "bogus=1", "page=abc"] {
            let f = Filter::parse(&super::super::page_query_of(unread));
            assert!(f.error.is_some(), "{unread}");
        }
    }
}
