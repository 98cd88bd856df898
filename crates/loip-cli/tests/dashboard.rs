//! The dashboard of `loip api --cluster` as a person opens it: the page at `/` (open, its
//! assets embedded), its data at `/dashboard.json` behind the API key, and the data's
//! numbers equal to `/metrics` after a generation. With Debian's `chromium` installed, the
//! page is also rendered headless during the run and a screenshot saved (skipped with the
//! reason otherwise). Helpers in `common/api.rs`.

mod common;
use common::api::*;
use common::*;

use serde_json::{json, Value};

const KEY: &str = "dashboard-test-key";

#[test]
fn the_dashboard_shows_the_plan_and_the_metrics_numbers() {
    let model = fixture("tiny-qwen3");
    let (dir, workers, cluster) = workers_and_cluster("dashboard", 2);
    let s = cluster_server(&model, &cluster, &["--api-key", KEY]);
    let auth = format!("Authorization: Bearer {KEY}\r\n");
    let get = |path: &str| http_with(&s.addr, "GET", path, &auth, b"");

    // the page and its assets are open and self-contained (no other host named)
    let page = http(&s.addr, "GET", "/", b"");
    assert_eq!(page.status, 200);
    assert!(page.head.contains("text/html"), "{}", page.head);
    let html = String::from_utf8_lossy(&page.body).to_string();
    assert!(html.contains("/dashboard.js") && html.contains("/dashboard.css"));
    for asset in ["/dashboard.js", "/dashboard.css"] {
        let r = http(&s.addr, "GET", asset, b"");
        assert_eq!(r.status, 200, "{asset}");
        let text = String::from_utf8_lossy(&r.body).to_string();
        assert!(
            !text.contains("http://") && !text.contains("https://"),
            "{asset}"
        );
    }
    // the data is behind the key
    assert_eq!(http(&s.addr, "GET", "/dashboard.json", b"").status, 401);

    let body = json!({"prompt": [3, 1, 4, 1, 5], "max_tokens": 6, "temperature": 0,
                      "ignore_eos": true});
    let r = http_with(
        &s.addr,
        "POST",
        "/v1/completions",
        &auth,
        body.to_string().as_bytes(),
    );
    assert_eq!(r.status, 200, "{}", String::from_utf8_lossy(&r.body));

    let d = get("/dashboard.json");
    assert_eq!(d.status, 200);
    let d: Value = d.json();
    let m = get("/metrics");
    assert_eq!(m.status, 200);
    let metrics = String::from_utf8_lossy(&m.body).to_string();
    let devices = d["devices"].as_array().expect("devices");
    assert_eq!(devices.len(), 2, "{d}");
    let plan = &d["plan"];
    let mut layers = 0;
    for (dev, name) in devices.iter().zip(["w1", "w2"]) {
        assert_eq!(dev["name"], name, "{d}");
        assert_eq!(dev["alive"], true, "{d}");
        assert!(dev["budget_bytes"].as_u64().unwrap_or(0) > 0, "{d}");
        assert!(dev["memory"]["budget"].as_u64().unwrap_or(0) > 0, "{d}");
        steps_match_metrics(dev, &metrics);
        let steps = &dev["steps"];
        assert!(steps["hops"].as_f64().unwrap_or(0.0) > 0.0, "{d}");
        let kv = dev["kv_used_bytes"].as_f64().unwrap_or(-1.0);
        assert_eq!(kv, metric(&metrics, "loip_kv_device_used_bytes", name));
        let planned = plan["devices"]
            .as_array()
            .and_then(|p| p.iter().find(|p| p["name"] == name))
            .expect("planned device");
        for st in planned["stages"].as_array().unwrap() {
            layers += st["layers"].as_array().unwrap().len();
        }
    }
    assert!(layers > 0, "{plan}");
    assert_eq!(d["scheduler"]["queued"], 0, "{d}");
    // the page rendered during a generation
    std::thread::scope(|sc| {
        sc.spawn(|| {
            let body = json!({"prompt": [3, 1, 4, 1, 5], "max_tokens": 48, "temperature": 0,
                              "ignore_eos": true});
            http_with(
                &s.addr,
                "POST",
                "/v1/completions",
                &auth,
                body.to_string().as_bytes(),
            )
        });
        screenshot(&s, &dir);
    });
    drop(s);
    drop(workers);
    let _ = std::fs::remove_dir_all(&dir);
}

/// With `chromium` on the PATH: the page rendered headless (the key given in the link's
/// fragment, as a person may bookmark it), saved as a PNG under the target directory.
fn screenshot(s: &Server, dir: &std::path::Path) {
    let Some(chromium) = chromium() else {
        eprintln!("skipping the dashboard screenshot: no chromium on the PATH");
        return;
    };
    let png = dir.join("dashboard.png");
    let out = std::process::Command::new(chromium)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--virtual-time-budget=3000",
            "--window-size=1200,900",
        ])
        .arg(format!("--screenshot={}", png.display()))
        .arg(format!("http://{}/#key={KEY}", s.addr))
        .output()
        .unwrap();
    assert!(
        out.status.success() && png.is_file(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let keep = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("dashboard.png");
    let _ = std::fs::copy(&png, &keep);
    eprintln!("dashboard screenshot: {}", keep.display());
}
