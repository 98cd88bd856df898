//! Typed reads of `config.json` fields: each names the key and what it expected when the
//! value is missing or of the wrong type (a checkpoint's config is untrusted input).

use serde_json::{Map, Value};

use crate::error::ModelError;

pub(super) fn as_usize(v: &Value) -> Option<usize> {
    v.as_u64().and_then(|n| usize::try_from(n).ok())
}

pub(super) fn req_usize(obj: &Map<String, Value>, key: &str) -> Result<usize, ModelError> {
    opt_usize(obj, key)?.ok_or_else(|| ModelError::config(key, "missing"))
}

pub(super) fn opt_usize(obj: &Map<String, Value>, key: &str) -> Result<Option<usize>, ModelError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => as_usize(v).map(Some).ok_or_else(|| {
            ModelError::config(key, format!("expected a non-negative integer, got {v}"))
        }),
    }
}

pub(super) fn opt_f32(obj: &Map<String, Value>, key: &str) -> Result<Option<f32>, ModelError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_f64()
            .map(|x| Some(x as f32))
            .ok_or_else(|| ModelError::config(key, format!("expected a number, got {v}"))),
    }
}

pub(super) fn opt_f32_in(
    obj: &Map<String, Value>,
    parent: &str,
    key: &str,
) -> Result<Option<f32>, ModelError> {
    opt_f32(obj, key).map_err(|e| match e {
        ModelError::InvalidConfig { field, reason } => ModelError::InvalidConfig {
            field: format!("{parent}.{field}"),
            reason,
        },
        other => other,
    })
}

pub(super) fn opt_bool(obj: &Map<String, Value>, key: &str) -> Result<Option<bool>, ModelError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_bool()
            .map(Some)
            .ok_or_else(|| ModelError::config(key, format!("expected true or false, got {v}"))),
    }
}

pub(super) fn opt_object<'a>(
    obj: &'a Map<String, Value>,
    key: &str,
) -> Result<Option<&'a Map<String, Value>>, ModelError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(m)) => Ok(Some(m)),
        Some(v) => Err(ModelError::config(
            key,
            format!("expected an object, got {v}"),
        )),
    }
}

pub(super) fn token_of(v: &Value, key: &str) -> Result<u32, ModelError> {
    v.as_u64()
        .and_then(|n| u32::try_from(n).ok())
        .ok_or_else(|| ModelError::config(key, format!("expected a token id, got {v}")))
}

pub(super) fn opt_token(obj: &Map<String, Value>, key: &str) -> Result<Option<u32>, ModelError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => token_of(v, key).map(Some),
    }
}

pub(super) fn token_list(obj: &Map<String, Value>, key: &str) -> Result<Vec<u32>, ModelError> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) => items.iter().map(|v| token_of(v, key)).collect(),
        Some(v) => Ok(vec![token_of(v, key)?]),
    }
}
