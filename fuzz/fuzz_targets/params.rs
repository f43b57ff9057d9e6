//! Request parameter parsing must answer every input with a value or a 4xx
//! problem, never a panic: names, durations, modes, query strings, JSON and
//! form bodies, for every route's parameter set.
//!
//! Input layout: byte 0 picks the body's content type, then the query string
//! up to the first NUL byte, then the body.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sidelock::config::parse_duration;
use sidelock::http::locks::{
    AdminParams, KeepaliveParams, ListParams, LockParams, SemaphoreParams, TokenParams,
};
use sidelock::http::params::parse;
use sidelock::lock::{LockKey, Name};

const CONTENT_TYPES: [Option<&str>; 5] = [
    None,
    Some("application/json"),
    Some("application/x-www-form-urlencoded"),
    Some("application/json; charset=utf-8"),
    Some("text/plain"),
];

fn check<T: serde::de::DeserializeOwned>(query: Option<&str>, ct: Option<&str>, body: &[u8]) {
    if let Err(e) = parse::<T>(query, ct, body) {
        let (status, _) = e.status_slug();
        assert!(status.is_client_error(), "{status} for bad input");
        let _ = e.problem();
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&selector, rest)) = data.split_first() else { return };
    let ct = CONTENT_TYPES[usize::from(selector) % CONTENT_TYPES.len()];
    let (query, body) = match rest.iter().position(|&b| b == 0) {
        Some(at) => (&rest[..at], &rest[at + 1..]),
        None => (rest, &[][..]),
    };
    let query = std::str::from_utf8(query).ok();
    check::<LockParams>(query, ct, body);
    check::<SemaphoreParams>(query, ct, body);
    check::<KeepaliveParams>(query, ct, body);
    check::<TokenParams>(query, ct, body);
    check::<ListParams>(query, ct, body);
    check::<AdminParams>(query, ct, body);
    if let Some(text) = query {
        let _ = Name::parse(text);
        let _ = LockKey::parse(text);
        let _ = parse_duration(text);
    }
});
