//! `GET /slots`: what each generation place (`--parallel`) is doing, in llama-server's shape:
//! `[{"id", "id_task", "n_ctx", "is_processing", "params": {..}, "next_token": {..}}]`.
//! Never the prompt's text: only counts and sampling settings.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use serde_json::{json, Value};

/// What a busy place runs.
#[derive(Debug, Clone)]
pub(crate) struct Task {
    /// the request's choice seed (requests are not numbered otherwise)
    pub(crate) id: u64,
    pub(crate) prompt_tokens: usize,
    pub(crate) max_tokens: usize,
    pub(crate) temperature: f32,
    pub(crate) constrained: bool,
    pub(crate) tools: bool,
}

struct Place {
    task: Mutex<Option<Task>>,
    decoded: AtomicUsize,
}

/// The places, one per `--parallel`.
pub(crate) struct Slots {
    places: Vec<Place>,
    n_ctx: usize,
}

/// A place held by one generation; freed when dropped.
pub(crate) struct Held<'a> {
    place: Option<&'a Place>,
}

impl Held<'_> {
    /// One more token generated.
    pub(crate) fn decoded(&self) {
        if let Some(p) = self.place {
            p.decoded.fetch_add(1, Ordering::Relaxed);
        }
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        if let Some(p) = self.place {
            if let Ok(mut t) = p.task.lock() {
                *t = None;
            }
        }
    }
}

impl Slots {
    pub(crate) fn new(parallel: usize, n_ctx: usize) -> Slots {
        Slots {
            places: (0..parallel)
                .map(|_| Place {
                    task: Mutex::new(None),
                    decoded: AtomicUsize::new(0),
                })
                .collect(),
            n_ctx,
        }
    }

    /// Takes the first free place for `task` (none when all are busy: the semaphore in front
    /// makes that not happen, and then the request simply does not show).
    pub(crate) fn take(&self, task: Task) -> Held<'_> {
        for p in &self.places {
            if let Ok(mut t) = p.task.lock() {
                if t.is_none() {
                    *t = Some(task);
                    p.decoded.store(0, Ordering::Relaxed);
                    return Held { place: Some(p) };
                }
            }
        }
        Held { place: None }
    }

    pub(crate) fn json(&self) -> Value {
        let places: Vec<Value> = self
            .places
            .iter()
            .enumerate()
            .map(|(id, p)| {
                let task = p.task.lock().ok().and_then(|t| t.clone());
                let n = p.decoded.load(Ordering::Relaxed);
                match task {
                    None => json!({"id": id, "id_task": -1, "n_ctx": self.n_ctx,
                                   "is_processing": false}),
                    Some(t) => json!({"id": id, "id_task": t.id, "n_ctx": self.n_ctx,
                        "is_processing": true,
                        "params": {"n_predict": t.max_tokens, "temperature": t.temperature,
                                   "seed": t.id, "constrained": t.constrained,
                                   "tools": t.tools},
                        "prompt_tokens": t.prompt_tokens,
                        "next_token": {"n_decoded": n,
                                       "n_remain": t.max_tokens.saturating_sub(n),
                                       "has_next_token": true}}),
                }
            })
            .collect();
        Value::Array(places)
    }
}
