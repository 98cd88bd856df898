//! One streaming completion over plain HTTP, timed: time to the first content, the gaps
//! between tokens, the tokens the server counted.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use eventsource_stream::Eventsource;
use futures_util::StreamExt;
use serde_json::Value;

use super::Sample;

/// One streaming request, timed.
pub(super) async fn one(
    client: &reqwest::Client,
    url: &reqwest::Url,
    key: Option<&str>,
    body: &str,
    timeout: Duration,
) -> Sample {
    let start = Instant::now();
    let mut s = match tokio::time::timeout(timeout, request(client, url, key, body, start)).await {
        Ok(Ok(s)) => s,
        Ok(Err(e)) => Sample {
            error: Some(format!("{e:#}")),
            ..Sample::default()
        },
        Err(_) => Sample {
            error: Some("timed out".into()),
            ..Sample::default()
        },
    };
    s.latency_s = start.elapsed().as_secs_f64();
    s
}

/// Most bytes of one response read.
const MAX_RESPONSE: usize = 16 << 20;

async fn request(
    client: &reqwest::Client,
    url: &reqwest::Url,
    key: Option<&str>,
    body: &str,
    start: Instant,
) -> Result<Sample> {
    let mut req = client
        .post(url.clone())
        .header("content-type", "application/json")
        .header("accept", "text/event-stream")
        .body(body.to_string());
    if let Some(k) = key {
        req = req.bearer_auth(k);
    }
    let resp = req
        .send()
        .await
        .with_context(|| format!("sending to {url}"))?;
    let status = resp.status();
    if !status.is_success() {
        let text = resp.text().await.unwrap_or_default();
        bail!(
            "HTTP {}: {}",
            status.as_u16(),
            text.chars().take(300).collect::<String>()
        );
    }
    let mut read = 0usize;
    let mut events = resp
        .bytes_stream()
        .map(move |chunk| {
            read += chunk.as_ref().map_or(0, |c| c.len());
            if read > MAX_RESPONSE {
                return Err(anyhow::anyhow!("a response over 16 MiB"));
            }
            chunk.map_err(anyhow::Error::from)
        })
        .eventsource();
    let mut times = SseTimes::default();
    while let Some(event) = events.next().await {
        let event = event.map_err(|e| anyhow::anyhow!("{e}"))?;
        times.take(&event.data, start);
        if times.done {
            break;
        }
    }
    if let Some(e) = times.error.take() {
        bail!("the stream reported an error: {e}");
    }
    if !times.done {
        bail!("the stream ended without [DONE]");
    }
    let tokens = times.usage.unwrap_or(times.content);
    let mut sample = Sample {
        tokens,
        ok: tokens > 0,
        ..Sample::default()
    };
    if let (Some(first), Some(last)) = (times.first, times.last) {
        sample.ttft_s = first;
        if tokens > 1 {
            sample.itl_s = Some((last - first) / (tokens - 1) as f64);
        }
    }
    Ok(sample)
}

/// What the server-sent events of one response said, timed.
#[derive(Default)]
struct SseTimes {
    first: Option<f64>, // first non-empty content  // s after start
    last: Option<f64>,  // last non-empty content  // s after start
    content: usize,     // non-empty content events
    usage: Option<usize>,
    error: Option<String>,
    done: bool,
}

impl SseTimes {
    /// One event's data.
    fn take(&mut self, data: &str, start: Instant) {
        let data = data.trim();
        if data == "[DONE]" {
            self.done = true;
            return;
        }
        let Ok(v) = serde_json::from_str::<Value>(data) else {
            return;
        };
        if let Some(e) = v.get("error") {
            self.error = Some(e.to_string());
        }
        if let Some(n) = v
            .pointer("/usage/completion_tokens")
            .and_then(Value::as_u64)
        {
            self.usage = Some(n as usize);
        }
        let text = v
            .pointer("/choices/0/text")
            .or_else(|| v.pointer("/choices/0/delta/content"))
            .and_then(Value::as_str)
            .unwrap_or("");
        if !text.is_empty() {
            let t = start.elapsed().as_secs_f64();
            self.first.get_or_insert(t);
            self.last = Some(t);
            self.content += 1;
        }
    }
}
