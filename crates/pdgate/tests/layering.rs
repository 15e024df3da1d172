//! No import cycle among pdgate's modules (docs/design.md, "Layout of pdgate"): every
//! `crate::<module>` path in a module's sources, outside its test files, is an edge, and the
//! graph of top-level modules must have no cycle. Cycles crept back once as features landed;
//! this keeps them out.
#![allow(clippy::unwrap_used, clippy::expect_used)] // tests: a panic is the failure report

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

fn sources(dir: &Path, out: &mut Vec<(String, String)>, root: &Path) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, out, root);
            continue;
        }
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if !name.ends_with(".rs") || name == "tests.rs" || name.ends_with("_tests.rs") {
            continue;
        }
        let rel = path.strip_prefix(root).unwrap();
        let top = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_string();
        if top == "lib" || top == "main" {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        // Inline unit tests may use anything.
        let text = match text.find("#[cfg(test)]\nmod tests {") {
            Some(i) => text[..i].to_string(),
            None => text,
        };
        out.push((top, text));
    }
}

/// The modules `from` reaches, following edges.
fn reachable(edges: &BTreeMap<String, BTreeSet<String>>, from: &str) -> BTreeSet<String> {
    let mut seen = BTreeSet::new();
    let mut stack = vec![from.to_string()];
    while let Some(m) = stack.pop() {
        for next in edges.get(&m).into_iter().flatten() {
            if seen.insert(next.clone()) {
                stack.push(next.clone());
            }
        }
    }
    seen
}

#[test]
fn no_import_cycle_among_pdgate_modules() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&root, &mut files, &root);
    let mut edges: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (top, text) in &files {
        for (i, _) in text.match_indices("crate::") {
            let name: String = text[i + "crate::".len()..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                .collect();
            if !name.is_empty() && name != *top {
                edges.entry(top.clone()).or_default().insert(name);
            }
        }
    }
    assert!(edges.len() > 10, "modules found: {edges:?}");
    let cyclic: Vec<&String> = edges
        .keys()
        .filter(|m| reachable(&edges, m).contains(*m))
        .collect();
    assert!(
        cyclic.is_empty(),
        "modules on an import cycle: {cyclic:?} (edges: {edges:?})"
    );
}
