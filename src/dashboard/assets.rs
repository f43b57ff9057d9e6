//! The dashboard's styles, script and icon, compiled into the binary (the
//! sidecar stays one file and works air-gapped) and served under a path that
//! carries a hash of their contents, so browsers may cache them forever.

use std::sync::OnceLock;

use axum::extract::Path;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use crate::error::Error;

/// One embedded file.
pub struct Asset {
    pub name: &'static str,
    pub content_type: &'static str,
    pub bytes: &'static [u8],
}

/// Every file under `static/`.
pub static ASSETS: &[Asset] = &[
    Asset {
        name: "app.css",
        content_type: "text/css; charset=utf-8",
        bytes: include_bytes!("../../static/app.css"),
    },
    Asset {
        name: "app.js",
        content_type: "text/javascript; charset=utf-8",
        bytes: include_bytes!("../../static/app.js"),
    },
    Asset {
        name: "favicon.svg",
        content_type: "image/svg+xml",
        bytes: include_bytes!("../../static/favicon.svg"),
    },
];

/// Cache lifetime of a versioned asset.
const IMMUTABLE: &str = "public, max-age=31536000, immutable";

/// 64-bit FNV-1a: a stable content hash for cache busting and ETags (not a
/// security boundary).
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for &b in *part {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// A short hex hash of `s`, for names that must not reveal `s`.
pub fn short_hash(s: &str) -> String {
    format!("{:08x}", fnv1a(&[s.as_bytes()]) as u32)
}

/// The hash of all assets: part of their URLs, so a new build never meets a stale cache.
pub fn version() -> &'static str {
    static VERSION: OnceLock<String> = OnceLock::new();
    VERSION.get_or_init(|| {
        let parts: Vec<&[u8]> = ASSETS
            .iter()
            .flat_map(|a| [a.name.as_bytes(), a.bytes])
            .collect();
        format!("{:012x}", fnv1a(&parts) >> 16)
    })
}

/// `/static/<version>`: the prefix the templates link assets under.
pub fn base() -> &'static str {
    static BASE: OnceLock<String> = OnceLock::new();
    BASE.get_or_init(|| format!("/static/{}", version()))
}

fn etag(asset: &Asset) -> String {
    format!("\"{:016x}\"", fnv1a(&[asset.bytes]))
}

/// `GET /static/{version}/{file}`: the file with a long cache lifetime and an
/// ETag; 304 when the browser already has it. A request for another version
/// (a page from before an upgrade) gets today's file, revalidated each time.
pub async fn serve(
    path: Result<Path<(String, String)>, axum::extract::rejection::PathRejection>,
    uri: axum::http::Uri,
    headers: HeaderMap,
) -> Response {
    // A path that is no text (`%ff`) names no asset either.
    let Ok(Path((version, file))) = path else {
        return Error::NotFound(uri.path().to_owned()).into_response();
    };
    let Some(asset) = ASSETS.iter().find(|a| a.name == file) else {
        return Error::NotFound(format!("/static/{version}/{file}")).into_response();
    };
    let etag = etag(asset);
    let cache = if version == self::version() {
        IMMUTABLE
    } else {
        "no-cache"
    };
    let fresh = headers
        .get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|t| t.trim() == etag || t.trim() == "*"));
    let tag = HeaderValue::from_str(&etag).unwrap_or(HeaderValue::from_static("\"0\""));
    if fresh {
        return (
            StatusCode::NOT_MODIFIED,
            [
                (header::ETAG, tag),
                (header::CACHE_CONTROL, HeaderValue::from_static(cache)),
            ],
        )
            .into_response();
    }
    (
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static(asset.content_type),
            ),
            (header::ETAG, tag),
            (header::CACHE_CONTROL, HeaderValue::from_static(cache)),
        ],
        asset.bytes,
    )
        .into_response()
}
