//! `loip worker`'s secrets at start (security round 3, item 9 and the Noise sessions): a
//! generated token goes to `STORE/token` only, stderr names the file and the device key.

mod common;

use std::io::{BufRead, BufReader, Read};
use std::process::Stdio;

#[test]
fn finding_9_a_generated_token_is_written_to_its_file_only() {
    let store = std::env::temp_dir().join(format!("loip-worker-keys-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&store);
    // off loopback (no traffic is sent: the worker only listens), so it makes a token
    let mut child = common::loip()
        .args([
            "worker",
            "--listen",
            "0.0.0.0:0",
            "--mem",
            "256MiB",
            "--no-announce",
            "--store",
        ])
        .arg(&store)
        .env_remove("LOIP_TOKEN")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    let _ = child.kill();
    let _ = child.wait();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(line.starts_with("listening on"), "{line}\n{err}");
    let token = std::fs::read_to_string(store.join("token")).unwrap();
    let token = token.trim();
    assert_eq!(token.len(), 64);
    assert!(!err.contains(token), "the token is on stderr:\n{err}");
    let path = store.join("token").display().to_string();
    assert!(err.contains(&path), "stderr does not name {path}:\n{err}");
    // the device key: printed once, its public half only
    let key = std::fs::read_to_string(store.join("device_key")).unwrap();
    assert!(
        !err.contains(key.trim()),
        "the private key is on stderr:\n{err}"
    );
    assert_eq!(err.matches("device key ").count(), 1, "{err}");
    let _ = std::fs::remove_dir_all(&store);
}
