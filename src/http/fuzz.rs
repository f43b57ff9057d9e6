//! The fuzz hook: every route's parameter parsing and checks, run on
//! arbitrary bytes. The cargo-fuzz target `params` (through the `fuzz`
//! feature) and the corpus replay test below call [`check_fuzz_input`]; it
//! sits above the parameter parser and the handlers' checks, which know
//! nothing of it. Release builds without the feature do not contain it.

use serde::de::DeserializeOwned;

use super::params::parse;
use crate::duration::parse_duration;
use crate::error::Error;
use crate::lock::Name;

/// Content types a fuzz input's first byte selects from.
const FUZZ_CONTENT_TYPES: [Option<&str>; 5] = [
    None,
    Some("application/json"),
    Some("application/x-www-form-urlencoded"),
    Some("application/json; charset=utf-8"),
    Some("text/plain"),
];

/// Parses one fuzz input with every route's parameter set, and names, keys
/// and durations, panicking if any answer is neither a value nor a 4xx
/// problem. Acquire and keepalive parameters that parse are then checked
/// against the default limits as a request's are (bounds, owner), and a
/// claim that passes must have sums of time that do not overflow. The cargo-fuzz target `params` and the corpus replay test
/// below both run it.
///
/// Input layout: byte 0 picks the body's content type, then the query string
/// up to the first NUL byte, then the body.
pub fn check_fuzz_input(data: &[u8]) {
    use crate::http::locks::{
        AdminParams, KeepaliveParams, ListParams, LockParams, SemaphoreParams, TokenParams,
    };
    use crate::lock::LockKey;

    fn client_error(e: &Error) {
        let (status, _) = e.status_slug();
        assert!(status.is_client_error(), "{status} for bad input");
        let _ = e.problem();
    }
    fn check<T: DeserializeOwned>(query: Option<&str>, ct: Option<&str>, body: &[u8]) -> Option<T> {
        parse::<T>(query, ct, body)
            .map_err(|e| client_error(&e))
            .ok()
    }
    fn claim(ask: crate::http::locks::Ask, limits: &crate::core::Limits) {
        let key = LockKey::parse("locks/fuzz").expect("a valid key");
        match ask.into_claim(key, limits, "fuzz") {
            Ok((claim, wait)) => {
                let now = crate::clock::now_ms();
                let _ = crate::clock::after(wait);
                for d in [Some(claim.ttl), Some(claim.lock_delay), claim.max_hold]
                    .into_iter()
                    .flatten()
                {
                    assert!(now.checked_add(crate::clock::ms(d)).is_some());
                }
            }
            Err(e) => client_error(&e),
        }
    }

    let Some((&selector, rest)) = data.split_first() else {
        return;
    };
    let ct = FUZZ_CONTENT_TYPES[usize::from(selector) % FUZZ_CONTENT_TYPES.len()];
    let (query, body) = match rest.iter().position(|&b| b == 0) {
        Some(at) => (&rest[..at], &rest[at + 1..]),
        None => (rest, &[][..]),
    };
    let query = std::str::from_utf8(query).ok();
    let limits = crate::core::Limits::default();
    if let Some(p) = check::<LockParams>(query, ct, body) {
        claim(p.into(), &limits);
    }
    if let Some(p) = check::<SemaphoreParams>(query, ct, body) {
        claim(p.into(), &limits);
    }
    if let Some(p) = check::<KeepaliveParams>(query, ct, body)
        && let Err(e) = crate::http::locks::check_ttl(p.ttl.as_ref(), &limits)
    {
        client_error(&e);
    }
    check::<TokenParams>(query, ct, body);
    check::<ListParams>(query, ct, body);
    if let Some(p) = check::<AdminParams>(query, ct, body)
        && let Err(e) = crate::http::locks::check_reason(p.reason)
    {
        client_error(&e);
    }
    if let Some(text) = query {
        let _ = Name::parse(text);
        let _ = LockKey::parse(text);
        let _ = parse_duration(text);
    }
}

#[cfg(test)]
mod tests {
    //! Replays the kept cargo-fuzz corpus (`fuzz/corpus/params`) through
    //! [`check_fuzz_input`], so every input the fuzzer ever found
    //! interesting stays a regression test on the stable toolchain.

    use std::path::Path;

    use super::check_fuzz_input;

    #[test]
    fn every_corpus_input_parses_to_a_value_or_a_4xx() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/params");
        let entries = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("read the fuzz corpus {}: {e}", dir.display()));
        let mut replayed = 0;
        for entry in entries {
            let path = entry.expect("corpus entry").path();
            let data =
                std::fs::read(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
            let outcome = std::panic::catch_unwind(|| check_fuzz_input(&data));
            assert!(
                outcome.is_ok(),
                "corpus input {} panicked; reproduce with `cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run params {}`",
                path.display(),
                path.display()
            );
            replayed += 1;
        }
        assert!(
            replayed > 1000,
            "only {replayed} corpus inputs in {}",
            dir.display()
        );
    }
}
