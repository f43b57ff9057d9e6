//! RFC 9457 problem responses.

use reqwest::header::CONTENT_TYPE;
use reqwest::{Response, StatusCode};
use serde_json::Value;

/// `urn:sidelock:problem:<slug>`.
pub fn problem_type(slug: &str) -> String {
    format!("urn:sidelock:problem:{slug}")
}

/// Asserts that `response` is a problem with `status` and type `slug`:
/// content type `application/problem+json`, `type` the slug's URN, `status`
/// repeated in the body, `title` and `detail` non-empty strings. Returns the
/// body for checks of extension members.
pub async fn assert_problem(response: Response, status: StatusCode, slug: &str) -> Value {
    let url = response.url().clone();
    let actual = response.status();
    let content_type = response
        .headers()
        .get(CONTENT_TYPE)
        .map(|v| v.to_str().unwrap_or("<non-ascii>").to_owned());
    let text = response
        .text()
        .await
        .unwrap_or_else(|e| panic!("{url}: read body: {e}"));
    let context =
        format!("{url}: expected {status} {slug}, got {actual} ({content_type:?}) {text}");

    assert_eq!(actual, status, "{context}");
    let essence = content_type
        .as_deref()
        .and_then(|ct| ct.split(';').next())
        .map(str::trim);
    assert_eq!(essence, Some("application/problem+json"), "{context}");

    let body: Value = serde_json::from_str(&text)
        .unwrap_or_else(|e| panic!("{context}: problem body is not JSON: {e}"));
    assert_eq!(body["type"], problem_type(slug), "{context}");
    assert_eq!(body["status"], status.as_u16(), "{context}");
    for member in ["title", "detail"] {
        assert!(
            body[member].as_str().is_some_and(|s| !s.trim().is_empty()),
            "{context}: `{member}` must be a non-empty string"
        );
    }
    body
}
