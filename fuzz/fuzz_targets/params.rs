//! Request parameter parsing must answer every input with a value or a 4xx
//! problem, never a panic: names, durations, modes, query strings, JSON and
//! form bodies, for every route's parameter set. The checks live in
//! `sidelock::http::fuzz::check_fuzz_input` (the `fuzz` feature), whose unit
//! tests also replay the kept corpus.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| sidelock::check_fuzz_input(data));
