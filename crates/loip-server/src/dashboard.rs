//! The dashboard: a small web page at `/` (HTML, CSS and JavaScript embedded in the binary,
//! no build step, no CDN) that polls `GET /dashboard.json` and `/metrics` every second and
//! shows the devices (memory against budget, stages, resident and streamed blocks), live
//! compute / network / load-stall / queueing per device, KV against each device's room with
//! adaptation's thresholds and lends, the request queue and throughput.
//!
//! The page itself holds no data and is open; `/dashboard.json` is behind the API key like
//! `/v1/*` and `/metrics` (the page asks for the key and keeps it in the browser's local
//! storage). Its numbers are the session's, the same `/metrics` reports.

use std::sync::Arc;

use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde_json::{json, Value};

use crate::backend::Backend;
use crate::state::App;

const PAGE: &str = include_str!("../assets/dashboard.html");
const SCRIPT: &str = include_str!("../assets/dashboard.js");
const STYLE: &str = include_str!("../assets/dashboard.css");

/// The dashboard's routes: the page and its assets (open), the data (behind the key).
pub(crate) fn routes(app: Arc<App>) -> Router<Arc<App>> {
    let data = Router::new()
        .route("/dashboard.json", get(data))
        .route_layer(axum::middleware::from_fn_with_state(
            app,
            crate::http::require_key,
        ));
    Router::new()
        .route("/", get(|| asset(PAGE, "text/html; charset=utf-8")))
        .route(
            "/dashboard.js",
            get(|| asset(SCRIPT, "text/javascript; charset=utf-8")),
        )
        .route(
            "/dashboard.css",
            get(|| asset(STYLE, "text/css; charset=utf-8")),
        )
        .merge(data)
}

async fn asset(body: &'static str, kind: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, kind),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

async fn data(State(app): State<Arc<App>>) -> Response {
    let backend = app.backend.clone();
    let name = app.name.clone();
    let parallel = app.parallel;
    // the session's lock is only tried, but reading it is still blocking work
    let body = tokio::task::spawn_blocking(move || snapshot(&backend, &name, parallel))
        .await
        .unwrap_or_else(|_| json!({"error": "the snapshot failed"}));
    Json(body).into_response()
}

/// The dashboard's numbers now: the serving loops' queue and KV, and for a cluster the plan
/// and each plan device's state, memory and step sums (the `/metrics` figures).
fn snapshot(backend: &Backend, name: &str, parallel: usize) -> Value {
    let st = backend.stats();
    let mut body = json!({
        "model": name,
        "placement": backend.describe(),
        "parallel": parallel,
        "scheduler": {
            "queued": st.queued, "running": st.running, "kv_used_bytes": st.kv_used,
            "kv_reserved_bytes": st.kv_reserved,
            "kv_budget_bytes": (st.kv_budget != u64::MAX).then_some(st.kv_budget),
            "steps": st.steps, "step_seconds": st.step_s,
        },
        "replanning": false,
        "plan": null,
        "devices": [],
    });
    let Some(session) = backend.session() else {
        // one device from slice files: its totals under the name `this`
        let d = &st.device;
        if d.compute_s > 0.0 || d.loaded_bytes > 0 {
            body["devices"] = json!([{
                "name": "this", "alive": true,
                "steps": {"compute_s": d.compute_s, "stall_s": d.load_stall_s,
                          "loaded_bytes": d.loaded_bytes, "network_s": 0.0, "queued_s": 0.0,
                          "hops": 0},
            }]);
        }
        return body;
    };
    let s = match session.try_lock() {
        Ok(s) => s,
        Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
        Err(std::sync::TryLockError::WouldBlock) => {
            body["replanning"] = json!(true);
            return body;
        }
    };
    let health = s.health();
    let stats = s.device_stats();
    let devices: Vec<Value> = s
        .plan
        .devices
        .iter()
        .map(|d| {
            let h = health.iter().find(|h| h.endpoint.name == d.name);
            let st = stats.iter().find(|x| x.name == d.name);
            let report = s.reports.iter().find(|r| r.endpoint.name == d.name);
            json!({
                "name": d.name,
                "addr": h.map(|h| h.endpoint.addr.clone()),
                "alive": h.is_some_and(|h| h.alive),
                "reason": h.and_then(|h| h.reason.clone()),
                "budget_bytes": d.budget_bytes,
                "planned_bytes": d.memory_bytes,
                "memory": report.and_then(|r| r.memory),
                "steps": st.map(|x| x.steps),
                "kv_used_bytes": st.map(|x| x.kv_used),
                "kv_budget_bytes": st.and_then(|x| x.kv_budget),
                "adapt": st.and_then(|x| x.adapt),
            })
        })
        .collect();
    body["devices"] = Value::Array(devices);
    body["plan"] = serde_json::to_value(&s.plan).unwrap_or(Value::Null);
    body["missing"] = json!(s.missing().iter().map(|e| &e.name).collect::<Vec<_>>());
    body
}
