//! See the crate doc of the hostile suite (`main.rs`).

#[allow(unused_imports)]
use crate::common;
