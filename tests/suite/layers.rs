//! The crate's modules form layers: `src/lib.rs`'s `# Layout` list names
//! them bottom layer first, and no module may use one listed after it. A
//! new import that reaches up (the backend seam into the core, the core
//! into HTTP, HTTP into the dashboard) fails here with the file and the
//! line, so the module graph stays a DAG that reads bottom-up.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const SRC: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/src");

/// The modules of the layout list, bottom first.
fn layout() -> Vec<String> {
    let lib = std::fs::read_to_string(Path::new(SRC).join("lib.rs")).expect("src/lib.rs");
    let header: Vec<String> = lib
        .lines()
        .take_while(|l| l.starts_with("//!"))
        .skip_while(|l| !l.contains("# Layout"))
        .filter_map(|l| l.strip_prefix("//! * [`"))
        .filter_map(|l| l.split('`').next())
        .map(str::to_owned)
        .collect();
    assert!(
        header.len() >= 10,
        "no layout list in src/lib.rs: {header:?}"
    );
    header
}

/// Every `.rs` file under `dir`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("read src") {
        let path = entry.expect("entry").path();
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a file belongs to (`src/http/locks.rs` → `http`).
fn module_of(path: &Path) -> Option<String> {
    let rel = path.strip_prefix(SRC).ok()?;
    let first = rel.components().next()?.as_os_str().to_str()?;
    let name = first.strip_suffix(".rs").unwrap_or(first);
    (!matches!(name, "lib" | "main")).then(|| name.to_owned())
}

/// The crate modules a line of code names (`crate::core::Core` → `core`).
fn named(line: &str) -> Vec<&str> {
    line.match_indices("crate::")
        .filter_map(|(at, _)| {
            let rest = &line[at + "crate::".len()..];
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            (end > 0).then(|| &rest[..end])
        })
        .collect()
}

#[test]
fn no_module_uses_one_above_it() {
    let layout = layout();
    let rank: BTreeMap<&str, usize> = layout
        .iter()
        .enumerate()
        .map(|(i, m)| (m.as_str(), i))
        .collect();
    let mut files = Vec::new();
    sources(Path::new(SRC), &mut files);
    files.sort();
    let mut problems = Vec::new();
    for file in &files {
        let Some(module) = module_of(file) else {
            continue;
        };
        let Some(&mine) = rank.get(module.as_str()) else {
            problems.push(format!(
                "{}: module {module} is not in src/lib.rs's layout list",
                file.display()
            ));
            continue;
        };
        let text = std::fs::read_to_string(file).expect("read source");
        for (n, line) in text.lines().enumerate() {
            // Comments name modules for the reader; only code ties them.
            if line.trim_start().starts_with("//") {
                continue;
            }
            for used in named(line) {
                if used == module {
                    continue;
                }
                match rank.get(used) {
                    Some(&theirs) if theirs > mine => problems.push(format!(
                        "{}:{}: {module} uses {used}, which is listed above it: {}",
                        file.display(),
                        n + 1,
                        line.trim()
                    )),
                    Some(_) => {}
                    None => problems.push(format!(
                        "{}:{}: {used} is not in the layout list",
                        file.display(),
                        n + 1
                    )),
                }
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_layout_list_names_every_module_once() {
    let layout = layout();
    let mut seen = std::collections::BTreeSet::new();
    for m in &layout {
        assert!(seen.insert(m), "{m} is listed twice");
    }
    let mut files = Vec::new();
    sources(Path::new(SRC), &mut files);
    let modules: std::collections::BTreeSet<String> =
        files.iter().filter_map(|f| module_of(f)).collect();
    let listed: std::collections::BTreeSet<String> = layout.into_iter().collect();
    assert_eq!(modules, listed, "src/ modules vs the layout list");
}

#[test]
fn the_reader_of_paths_reads_them() {
    assert_eq!(
        named("use crate::core::{Core, Limits}; crate::http::App"),
        ["core", "http"]
    );
    assert!(named("use super::x;").is_empty());
}
