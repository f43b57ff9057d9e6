//! Replays the kept cargo-fuzz corpus (`fuzz/corpus/params`) through the
//! parameter parsing checks of the fuzz target, so every input the fuzzer
//! ever found interesting stays a regression test on the stable toolchain.

use std::path::Path;

#[test]
fn every_corpus_input_parses_to_a_value_or_a_4xx() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/params");
    let entries = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("read the fuzz corpus {}: {e}", dir.display()));
    let mut replayed = 0;
    for entry in entries {
        let path = entry.expect("corpus entry").path();
        let data = std::fs::read(&path).unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
        let outcome = std::panic::catch_unwind(|| sidelock::http::fuzz::check_fuzz_input(&data));
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
