//! Every scenario written is a scenario run: a `pub async fn (env: Env)` in a group file
//! that is missing from `__for_each_scenario!` would silently never run on any backend.

use std::collections::BTreeSet;
use std::fs;
use std::path::Path;

#[test]
fn every_scenario_is_listed_once_and_there_are_at_least_sixty() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("src").join("scenarios");
    let mut written = BTreeSet::new();
    for entry in fs::read_dir(&dir).expect("scenarios dir") {
        let path = entry.expect("entry").path();
        let group = path.file_stem().and_then(|s| s.to_str()).expect("file name").to_owned();
        if group == "mod" {
            continue;
        }
        let text = fs::read_to_string(&path).expect("group file");
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("pub async fn ")
                && let Some((name, args)) = rest.split_once('(')
                && args.starts_with("env: Env)")
            {
                assert!(written.insert(format!("{group}::{name}")), "{group}::{name} written twice");
            }
        }
    }
    let registry = fs::read_to_string(dir.join("mod.rs")).expect("mod.rs");
    let mut listed = BTreeSet::new();
    for line in registry.lines() {
        if let Some(rest) = line.trim().strip_prefix("$m!($backend, ")
            && let Some(path) = rest.strip_suffix(");")
        {
            assert!(listed.insert(path.to_owned()), "{path} listed twice in __for_each_scenario!");
        }
    }
    let unlisted: Vec<_> = written.difference(&listed).collect();
    assert!(unlisted.is_empty(), "scenarios written but never run: {unlisted:?}");
    let unknown: Vec<_> = listed.difference(&written).collect();
    assert!(unknown.is_empty(), "listed but not found: {unknown:?}");
    assert!(listed.len() >= 60, "the suite promises at least 60 scenarios, has {}", listed.len());
    let names: BTreeSet<_> = listed.iter().map(|p| p.rsplit("::").next().expect("name")).collect();
    assert_eq!(names.len(), listed.len(), "scenario names must be unique: they become test names");
}
