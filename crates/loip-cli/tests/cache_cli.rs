//! `loip list` and `loip rm` on a cache of their own (`LOIP_CACHE`): entries with their
//! sizes, removal by the listed name, and names that are not entries (a path out of the
//! cache included) refused with nothing removed.

mod common;
use common::*;

#[test]
fn list_shows_the_cache_and_rm_removes_only_listed_entries() {
    let cache = std::env::temp_dir().join(format!("loip-cache-cli-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&cache);
    std::fs::create_dir_all(cache.join("smollm2")).unwrap();
    std::fs::create_dir_all(cache.join("slices/tiny-1234")).unwrap();
    std::fs::write(cache.join("smollm2/m.gguf"), vec![0u8; 3000]).unwrap();
    std::fs::write(cache.join("slices/tiny-1234/attn.0"), vec![0u8; 1000]).unwrap();
    let outside = cache.with_extension("outside");
    std::fs::create_dir_all(&outside).unwrap();
    let run = |args: &[&str]| {
        loip()
            .args(args)
            .env("LOIP_CACHE", &cache)
            .output()
            .unwrap()
    };

    let out = run(&["list", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<serde_json::Value> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 2, "{rows:?}");
    assert_eq!(rows[0]["name"], "slices/tiny-1234");
    assert_eq!(rows[0]["bytes"], 1000);
    assert_eq!(rows[1]["name"], "smollm2");
    assert_eq!(rows[1]["bytes"], 3000);
    let text = run(&["list"]);
    assert!(String::from_utf8_lossy(&text.stdout).contains("smollm2"));
    assert!(String::from_utf8_lossy(&text.stderr).contains("2 entries"));

    // one bad name: nothing removed
    let bad = run(&["rm", "smollm2", "../loip-cache-outside"]);
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("no cache entry"));
    assert!(cache.join("smollm2").is_dir() && outside.is_dir());

    let ok = run(&["rm", "slices/tiny-1234"]);
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    assert!(!cache.join("slices/tiny-1234").exists() && cache.join("smollm2").is_dir());
    let _ = std::fs::remove_dir_all(&cache);
    let _ = std::fs::remove_dir_all(&outside);
}
