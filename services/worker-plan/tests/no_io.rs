//! The crate decides and does nothing else: no dependency that could reach a network, a
//! database, a runtime or a clock, and no read of the clock, the environment, files or sockets
//! through the standard library. A change that needs one belongs in the worker, which passes
//! what it read in as an argument.

use std::path::Path;

/// What the decisions may depend on: data types, encodings, hashing and certificate building.
const ALLOWED: &[&str] = &[
    "api-types",
    "base64",
    "hex",
    "rcgen",
    "serde",
    "serde_json",
    "sha2",
    "thiserror",
    "time",
    "uuid",
    "x509-parser",
];

#[test]
fn depends_on_nothing_that_does_io() {
    let manifest =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.toml")).unwrap();
    let mut section = "";
    let mut found = Vec::new();
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            section = line;
            continue;
        }
        if section == "[dependencies]" && !line.is_empty() && !line.starts_with('#') {
            let name = line.split(['=', '.']).next().unwrap().trim();
            found.push(name.to_string());
        }
    }
    assert!(!found.is_empty(), "no [dependencies] read from Cargo.toml");
    let foreign: Vec<&String> = found
        .iter()
        .filter(|d| !ALLOWED.contains(&d.as_str()))
        .collect();
    assert!(
        foreign.is_empty(),
        "dependencies that may do I/O: {foreign:?}"
    );
}

#[test]
fn reads_no_clock_environment_file_or_socket() {
    const FORBIDDEN: &[&str] = &[
        "SystemTime::now",
        "Instant::now",
        "OffsetDateTime::now",
        "std::env",
        "std::fs",
        "TcpStream",
        "TcpListener",
        "UdpSocket",
        "to_socket_addrs",
        "std::process",
        "std::thread",
    ];
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut dirs = vec![src.clone()];
    let (mut read, mut nested) = (0, 0);
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs") {
                continue;
            }
            let text = std::fs::read_to_string(&path).unwrap();
            // Tests may build their inputs however they like.
            let code = text.split("#[cfg(test)]").next().unwrap();
            for word in FORBIDDEN {
                assert!(!code.contains(word), "{} uses {word}", path.display());
            }
            read += 1;
            nested += usize::from(path.parent() != Some(src.as_path()));
        }
    }
    assert!(read >= 5, "read only {read} source files");
    assert!(nested >= 1, "read no source file below src/");
}
