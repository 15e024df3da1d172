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

/// A file's module path below its crate's `src` (`pd/select.rs` -> `["pd", "select"]`).
fn module_path(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().to_string())
        .collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    if parts.len() == 1 && (parts[0] == "lib" || parts[0] == "main") {
        parts.clear();
    }
    parts
}

/// The file that defines the longest prefix of `path` that is a module of the crate.
fn module_file(src: &Path, path: &[String]) -> Option<std::path::PathBuf> {
    for n in (0..=path.len()).rev() {
        if n == 0 {
            return ["lib.rs", "main.rs"]
                .iter()
                .map(|f| src.join(f))
                .find(|f| f.exists());
        }
        let dir = path[..n].iter().fold(src.to_path_buf(), |d, p| d.join(p));
        for candidate in [dir.with_extension("rs"), dir.join("mod.rs")] {
            if candidate.exists() {
                return Some(candidate);
            }
        }
    }
    None
}

/// The files one source file reaches through `crate::` and `super::` paths (outside comments and
/// its inline tests).
fn file_edges(src: &Path, file: &Path) -> BTreeSet<std::path::PathBuf> {
    let text = std::fs::read_to_string(file).unwrap();
    let text = match text.find("#[cfg(test)]\nmod tests {") {
        Some(i) => &text[..i],
        None => &text[..],
    };
    let here = module_path(src, file);
    let mut out = BTreeSet::new();
    for line in text.lines() {
        let code = line.split("//").next().unwrap_or_default();
        for head in ["crate::", "super::"] {
            for (i, _) in code.match_indices(head) {
                let before = code[..i].chars().next_back();
                if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == ':') {
                    continue;
                }
                let rest: Vec<String> = code[i + head.len()..]
                    .split("::")
                    .map(|s| {
                        s.chars()
                            .take_while(|c| c.is_alphanumeric() || *c == '_')
                            .collect::<String>()
                    })
                    .take_while(|s| !s.is_empty())
                    .collect();
                let mut path = if head == "crate::" {
                    Vec::new()
                } else {
                    here[..here.len().saturating_sub(1)].to_vec()
                };
                let mut rest = rest.as_slice();
                while rest.first().is_some_and(|s| s == "super") {
                    path.pop();
                    rest = &rest[1..];
                }
                path.extend(rest.iter().cloned());
                if let Some(target) = module_file(src, &path)
                    && target != file
                {
                    out.insert(target);
                }
            }
        }
    }
    out
}

fn rust_files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            let name = path.file_name().unwrap().to_string_lossy().to_string();
            if name != "tests.rs" && !name.ends_with("_tests.rs") {
                out.push(path);
            }
        }
    }
}

/// No import circle between two files of any crate of the workspace (issue 36): following the
/// `crate::`/`super::` paths of each file (outside its tests), no file reaches itself. A circle
/// between files is a knot a reader must hold in mind at once; breaking it names which of the
/// two is the lower layer.
#[test]
fn no_import_circle_between_files_in_any_crate() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut checked = 0;
    let mut circles = Vec::new();
    for entry in std::fs::read_dir(&crates).unwrap() {
        let src = entry.unwrap().path().join("src");
        if !src.is_dir() {
            continue;
        }
        let mut files = Vec::new();
        rust_files(&src, &mut files);
        let edges: BTreeMap<String, BTreeSet<String>> = files
            .iter()
            .map(|f| {
                let name = |p: &Path| p.strip_prefix(&crates).unwrap().display().to_string();
                let to = file_edges(&src, f).iter().map(|t| name(t)).collect();
                (name(f), to)
            })
            .collect();
        checked += edges.len();
        circles.extend(
            edges
                .keys()
                .filter(|f| reachable(&edges, f).contains(*f))
                .cloned(),
        );
    }
    assert!(checked > 100, "files checked: {checked}");
    assert!(circles.is_empty(), "files on an import circle: {circles:?}");
}
