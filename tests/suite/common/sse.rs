//! A minimal Server-Sent-Events reader over `reqwest`'s byte stream, and the
//! typed hold-stream events on top of it. Every read has a deadline.

use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use eventsource_stream::{Event, EventStreamError, Eventsource};
use futures::{Stream, StreamExt};
use reqwest::header::CONTENT_TYPE;
use reqwest::{Response, StatusCode};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use super::EVENT_TIMEOUT;
use super::api::Grant;

/// One dispatched event: its `event:` name and its `data:` lines joined by `\n`.
#[derive(Debug, Clone)]
pub struct SseEvent {
    pub event: String,
    pub data: String,
}

impl SseEvent {
    pub fn json(&self) -> Value {
        self.parse()
    }

    pub fn parse<T: DeserializeOwned>(&self) -> T {
        serde_json::from_str(&self.data).unwrap_or_else(|e| {
            panic!(
                "data of SSE event `{}` is not the expected JSON ({e}): {}",
                self.event, self.data
            )
        })
    }
}

/// The parsed events of a response body, or the transport error that ended it.
type EventStream =
    Pin<Box<dyn Stream<Item = Result<Event, EventStreamError<reqwest::Error>>> + Send>>;

/// An open SSE response. Dropping it closes the connection.
pub struct SseStream {
    url: String,
    events: EventStream,
    ended: bool,
    /// Everything received, for assertions over the raw text (appended to
    /// as the parser reads the body).
    raw: Arc<Mutex<String>>,
    /// Why the body ended, if it ended with a transport error.
    error: Option<String>,
}

impl SseStream {
    /// Wraps a response that must be `200 text/event-stream`.
    pub async fn from_response(response: Response) -> Self {
        let url = response.url().to_string();
        let status = response.status();
        let content_type = response
            .headers()
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_owned();
        if status != StatusCode::OK || !content_type.starts_with("text/event-stream") {
            let body = response.text().await.unwrap_or_default();
            panic!("{url}: expected 200 text/event-stream, got {status} `{content_type}`: {body}");
        }
        let raw = Arc::new(Mutex::new(String::new()));
        let seen = Arc::clone(&raw);
        let events = response
            .bytes_stream()
            .inspect(move |chunk| {
                if let Ok(bytes) = chunk {
                    seen.lock()
                        .expect("raw text lock")
                        .push_str(&String::from_utf8_lossy(bytes));
                }
            })
            .eventsource();
        Self {
            url,
            events: Box::pin(events),
            ended: false,
            raw,
            error: None,
        }
    }

    /// The next event, `Ok(None)` once the stream has ended, `Err(())` if
    /// nothing arrived within `timeout`.
    pub async fn next_within(&mut self, timeout: Duration) -> Result<Option<SseEvent>, ()> {
        let deadline = tokio::time::Instant::now() + timeout;
        if self.ended {
            return Ok(None);
        }
        match tokio::time::timeout_at(deadline, self.events.next()).await {
            Err(_) => Err(()),
            Ok(Some(Ok(event))) => Ok(Some(SseEvent {
                event: event.event,
                data: event.data,
            })),
            Ok(Some(Err(e))) => {
                self.error = Some(e.to_string());
                self.ended = true;
                Ok(None)
            }
            Ok(None) => {
                self.ended = true;
                Ok(None)
            }
        }
    }

    /// The next event (`None` once ended), panicking after [`EVENT_TIMEOUT`].
    pub async fn next(&mut self) -> Option<SseEvent> {
        self.next_or_panic(EVENT_TIMEOUT).await
    }

    async fn next_or_panic(&mut self, timeout: Duration) -> Option<SseEvent> {
        self.next_within(timeout).await.unwrap_or_else(|()| {
            panic!(
                "{}: no SSE event within {timeout:?}; received so far:\n{}",
                self.url,
                self.raw()
            )
        })
    }

    /// Skips events until one satisfies `wanted`, panicking if the stream
    /// ends or `timeout` passes first.
    pub async fn wait_for(
        &mut self,
        what: &str,
        timeout: Duration,
        mut wanted: impl FnMut(&SseEvent) -> bool,
    ) -> SseEvent {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.next_within(left).await {
                Ok(Some(event)) if wanted(&event) => return event,
                Ok(Some(_)) => {}
                Ok(None) => panic!(
                    "{}: stream ended before {what} (error: {:?}); received:\n{}",
                    self.url,
                    self.error,
                    self.raw()
                ),
                Err(()) => panic!(
                    "{}: no {what} within {timeout:?}; received:\n{}",
                    self.url,
                    self.raw()
                ),
            }
        }
    }

    /// Asserts that the stream ends within `timeout` (possibly after more
    /// events, which are returned).
    pub async fn expect_end(&mut self, timeout: Duration) -> Vec<SseEvent> {
        let deadline = Instant::now() + timeout;
        let mut rest = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.next_within(left).await {
                Ok(Some(event)) => rest.push(event),
                Ok(None) => return rest,
                Err(()) => panic!(
                    "{}: stream still open after {timeout:?}; received:\n{}",
                    self.url,
                    self.raw()
                ),
            }
        }
    }

    /// Everything received so far, byte for byte (lossy UTF-8).
    pub fn raw(&self) -> String {
        self.raw.lock().expect("raw text lock").clone()
    }
}

/// `queued` data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct Queued {
    pub position: u64,
    pub queue_length: u64,
}

/// `renewed` data.
#[derive(Debug, Clone, Copy, Deserialize)]
pub struct Renewed {
    pub expires_at_ms: u64,
    #[serde(default)]
    pub ttl_ms: Option<u64>,
}

/// A typed event of a hold stream (`GET …/hold`).
#[derive(Debug, Clone)]
pub enum HoldEvent {
    Queued(Queued),
    Acquired(Grant),
    Renewed(Renewed),
    /// `lost`, with its `reason`.
    Lost(String),
    /// `timeout`, with its data (`{"waited_ms"}`).
    Timeout(Value),
}

impl HoldEvent {
    fn decode(event: &SseEvent) -> Self {
        match event.event.as_str() {
            "queued" => Self::Queued(event.parse()),
            "acquired" => Self::Acquired(event.parse()),
            "renewed" => Self::Renewed(event.parse()),
            "lost" => {
                let data = event.json();
                let reason = data["reason"]
                    .as_str()
                    .unwrap_or_else(|| panic!("`lost` event without a string reason: {data}"));
                Self::Lost(reason.to_owned())
            }
            "timeout" => Self::Timeout(if event.data.is_empty() {
                Value::Null
            } else {
                event.json()
            }),
            other => panic!("unexpected hold event `{other}`: {}", event.data),
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Self::Queued(_) => "queued",
            Self::Acquired(_) => "acquired",
            Self::Renewed(_) => "renewed",
            Self::Lost(_) => "lost",
            Self::Timeout(_) => "timeout",
        }
    }
}

/// An open hold stream. Dropping it closes the connection, which releases
/// the lease or leaves the queue.
pub struct HoldStream {
    sse: SseStream,
}

impl HoldStream {
    pub fn new(sse: SseStream) -> Self {
        Self { sse }
    }

    /// The next event, `Ok(None)` once the stream ended, `Err(())` on timeout.
    pub async fn next_within(&mut self, timeout: Duration) -> Result<Option<HoldEvent>, ()> {
        Ok(self
            .sse
            .next_within(timeout)
            .await?
            .map(|e| HoldEvent::decode(&e)))
    }

    /// Skips events for which `skip` is true and returns the first other
    /// one, panicking if the stream ends or `timeout` passes first.
    async fn next_skipping(
        &mut self,
        what: &str,
        timeout: Duration,
        skip: impl Fn(&HoldEvent) -> bool,
    ) -> HoldEvent {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.next_within(left).await {
                Ok(Some(event)) if skip(&event) => {}
                Ok(Some(event)) => return event,
                Ok(None) => panic!(
                    "{}: hold stream ended while expecting {what}; received:\n{}",
                    self.sse.url,
                    self.sse.raw()
                ),
                Err(()) => panic!(
                    "{}: no {what} within {timeout:?}; received:\n{}",
                    self.sse.url,
                    self.sse.raw()
                ),
            }
        }
    }

    fn unexpected(&self, what: &str, event: &HoldEvent) -> ! {
        panic!(
            "{}: expected {what}, got {event:?}; received:\n{}",
            self.sse.url,
            self.sse.raw()
        )
    }

    /// The next event must be `queued`.
    pub async fn expect_queued(&mut self) -> Queued {
        match self
            .next_skipping("`queued`", EVENT_TIMEOUT, |_| false)
            .await
        {
            HoldEvent::Queued(queued) => queued,
            other => self.unexpected("`queued`", &other),
        }
    }

    /// Skips `queued` updates until one reports `position`.
    pub async fn expect_position(&mut self, position: u64) -> Queued {
        let what = format!("`queued` with position {position}");
        let event = self
            .next_skipping(
                &what,
                EVENT_TIMEOUT,
                |e| matches!(e, HoldEvent::Queued(q) if q.position != position),
            )
            .await;
        match event {
            HoldEvent::Queued(queued) => queued,
            other => self.unexpected(&what, &other),
        }
    }

    /// Skips `queued` updates; the next event must be `acquired`.
    pub async fn expect_acquired(&mut self) -> Grant {
        self.expect_acquired_within(EVENT_TIMEOUT).await
    }

    pub async fn expect_acquired_within(&mut self, timeout: Duration) -> Grant {
        let event = self
            .next_skipping("`acquired`", timeout, |e| matches!(e, HoldEvent::Queued(_)))
            .await;
        match event {
            HoldEvent::Acquired(grant) => grant,
            other => self.unexpected("`acquired`", &other),
        }
    }

    /// Skips `renewed` events; the next event must be `lost`. Returns the reason.
    pub async fn expect_lost(&mut self) -> String {
        self.expect_lost_within(EVENT_TIMEOUT).await
    }

    pub async fn expect_lost_within(&mut self, timeout: Duration) -> String {
        let event = self
            .next_skipping("`lost`", timeout, |e| matches!(e, HoldEvent::Renewed(_)))
            .await;
        match event {
            HoldEvent::Lost(reason) => reason,
            other => self.unexpected("`lost`", &other),
        }
    }

    /// Skips `queued` updates; the next event must be `timeout`. Returns its data.
    pub async fn expect_timeout(&mut self) -> Value {
        let event = self
            .next_skipping("`timeout`", EVENT_TIMEOUT, |e| {
                matches!(e, HoldEvent::Queued(_))
            })
            .await;
        match event {
            HoldEvent::Timeout(data) => data,
            other => self.unexpected("`timeout`", &other),
        }
    }

    /// The stream must end (EOF) with no further event within [`EVENT_TIMEOUT`].
    pub async fn expect_end(&mut self) {
        let rest = self.sse.expect_end(EVENT_TIMEOUT).await;
        assert!(
            rest.is_empty(),
            "{}: expected the hold stream to end, got more events: {rest:?}",
            self.sse.url
        );
    }

    /// Waits for the stream to end (within [`EVENT_TIMEOUT`]) and returns the
    /// events that arrived before the end.
    pub async fn until_end(&mut self) -> Vec<HoldEvent> {
        let rest = self.sse.expect_end(EVENT_TIMEOUT).await;
        rest.iter().map(HoldEvent::decode).collect()
    }

    /// Collects every event that arrives during `window` (the stream must
    /// stay open).
    pub async fn collect_for(&mut self, window: Duration) -> Vec<HoldEvent> {
        let deadline = Instant::now() + window;
        let mut events = Vec::new();
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.next_within(left).await {
                Ok(Some(event)) => events.push(event),
                Ok(None) => panic!(
                    "{}: hold stream ended during a {window:?} window; received:\n{}",
                    self.sse.url,
                    self.sse.raw()
                ),
                Err(()) => return events,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Eventsource, StreamExt};

    /// The parser the harness relies on (the same `sidelock run` and the
    /// bench use) reads the sidecar's framing however the chunks split it.
    #[tokio::test]
    async fn parses_events_comments_and_split_chunks() {
        let chunks = [
            ": keep-alive\n\nevent: queu",
            "ed\ndata: {\"position\":1}\n\n",
            "event:acquired\r\ndata: {\"a\":1}\r",
            "\ndata: {\"b\":2}\r\n\r\n",
            "data: plain\n\n",
        ];
        let events: Vec<_> = futures::stream::iter(chunks.map(Ok::<_, std::io::Error>))
            .eventsource()
            .map(|e| e.expect("event"))
            .collect()
            .await;
        let got: Vec<(&str, &str)> = events
            .iter()
            .map(|e| (e.event.as_str(), e.data.as_str()))
            .collect();
        assert_eq!(
            got,
            [
                ("queued", "{\"position\":1}"),
                ("acquired", "{\"a\":1}\n{\"b\":2}"),
                ("message", "plain"),
            ]
        );
    }
}
