//! Slice files for offloading, and the slice cache that `--mem`, `loip local` and a cluster
//! use: a model split once per checkpoint version, keyed by its path, size and mtime.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use loip_model::slice::{self, SplitOutcome, SplitProgress, MANIFEST};

/// Progress of a split: bytes written of the bytes to write.
pub type OnSplit<'a> = &'a dyn Fn(u64, u64);

/// Splits `model` into `out` (no work when it is up to date), telling `on_split` the bytes
/// written.
pub fn split_into(model: &str, out: &Path, on_split: OnSplit<'_>) -> Result<()> {
    let ckpt = crate::model::open(model)?;
    let outcome = slice::split(&ckpt, out, SplitProgress { on_bytes: on_split })
        .with_context(|| format!("splitting into {}", out.display()))?;
    if outcome == SplitOutcome::UpToDate {
        tracing::info!("{} is up to date", out.display());
    }
    Ok(())
}

/// Where `model`'s slice files are: the directory itself when it already is one, else its
/// place in the cache, keyed by the checkpoint's path, size and mtime.
pub struct Location {
    /// the slice directory
    pub dir: PathBuf,
    /// `dir` holds a complete split of the checkpoint as it is now (always for a slice
    /// directory given as the model)
    pub current: bool,
    /// the checkpoint's resolved path (`None` for a slice directory given as the model)
    source: Option<(PathBuf, String)>,
}

/// [`Location`] of `model`'s slices, without splitting: whether [`slices_for`] would split.
pub fn locate(model: &str) -> Result<Location> {
    let p = Path::new(model);
    if p.join(MANIFEST).is_file() {
        return Ok(Location {
            dir: p.to_path_buf(),
            current: true,
            source: None,
        });
    }
    let ckpt = crate::model::open(model)?;
    let path = ckpt.dir_or_file.clone();
    let stamp = slice::source_stamp(&ckpt)?;
    let key = format!("{}|{}|{}", stamp.path, stamp.bytes, stamp.mtime);
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    let dir = loip_model::fetch::cache_dir()
        .join("slices")
        .join(format!("{stem}-{}", slice::crc32_hex(key.as_bytes())));
    Ok(Location {
        current: slice::is_current(&dir, &stamp),
        dir,
        source: Some((path, stamp.path)),
    })
}

/// A slice directory for `model`: the directory itself when it already is one, else a split
/// in the cache keyed by the checkpoint's path, size and mtime (made on first use, telling
/// `on_split` the bytes written). Splitting leaves a few MiB of this process's heap
/// fragmented; a process that then measures itself for a budget can split in a child process
/// first (the CLI runs `loip split`), after which this finds the split current.
pub fn slices_for(model: &str, on_split: OnSplit<'_>) -> Result<PathBuf> {
    let Location { dir, source, .. } = locate(model)?;
    let Some((path, source)) = source else {
        return Ok(dir);
    };
    split_into(&path.to_string_lossy(), &dir, on_split)?;
    if let Some(cache) = dir.parent() {
        for (old, bytes) in prune_stale_splits(cache, &dir, &source) {
            tracing::warn!(
                "removed the stale slice cache {} ({:.1} MiB) of an earlier version of {}",
                old.display(),
                bytes as f64 / (1 << 20) as f64,
                source
            );
        }
    }
    Ok(dir)
}

/// Removes the complete splits in `cache` (a directory of slice directories) that were made
/// from `source` but are not `current`: splits of an earlier version of the same checkpoint
/// (another size or mtime) or of an older manifest format, which nothing reads again. A
/// directory without a readable manifest (a split in progress) is left alone. Returns what
/// was removed, with its size.
fn prune_stale_splits(cache: &Path, current: &Path, source: &str) -> Vec<(PathBuf, u64)> {
    let Ok(entries) = std::fs::read_dir(cache) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for e in entries.flatten() {
        let dir = e.path();
        if dir == current || !dir.is_dir() {
            continue;
        }
        // any manifest version: only its source path is read
        let from_source = std::fs::read_to_string(dir.join(MANIFEST))
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
            .and_then(|m| m["source"]["path"].as_str().map(|p| p == source))
            .unwrap_or(false);
        if !from_source {
            continue;
        }
        let bytes = std::fs::read_dir(&dir)
            .map(|fs| {
                fs.flatten()
                    .filter_map(|f| f.metadata().ok())
                    .map(|m| m.len())
                    .sum()
            })
            .unwrap_or(0);
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => removed.push((dir, bytes)),
            Err(e) => tracing::warn!("cannot remove the stale slice cache {}: {e}", dir.display()),
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split_dir(root: &Path, name: &str, manifest: Option<&str>) -> PathBuf {
        let d = root.join(name);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join("attn.0.slice"), vec![0u8; 4096]).unwrap();
        if let Some(m) = manifest {
            std::fs::write(d.join(MANIFEST), m).unwrap();
        }
        d
    }

    #[test]
    fn prunes_only_complete_older_splits_of_the_same_source() {
        let root = std::env::temp_dir().join(format!("loip-prune-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let m = |path: &str, version: u32| {
            format!(
                r#"{{"version": {version}, "source": {{"path": "{path}", "bytes": 1, "mtime": 2}}}}"#
            )
        };
        let current = split_dir(&root, "model-aaaa", Some(&m("/m/model.gguf", 2)));
        let older = split_dir(&root, "model-bbbb", Some(&m("/m/model.gguf", 2)));
        let old_format = split_dir(&root, "model-cccc", Some(&m("/m/model.gguf", 1)));
        let other = split_dir(&root, "model-dddd", Some(&m("/elsewhere/model.gguf", 2)));
        let in_progress = split_dir(&root, "model-eeee", None);
        let garbage = split_dir(&root, "model-ffff", Some("not json"));

        let mut removed = prune_stale_splits(&root, &current, "/m/model.gguf");
        removed.sort();
        assert_eq!(
            removed.iter().map(|(d, _)| d.clone()).collect::<Vec<_>>(),
            vec![older.clone(), old_format.clone()]
        );
        assert!(removed.iter().all(|(_, b)| *b >= 4096));
        assert!(!older.exists() && !old_format.exists());
        for kept in [&current, &other, &in_progress, &garbage] {
            assert!(kept.join("attn.0.slice").exists(), "{}", kept.display());
        }
        std::fs::remove_dir_all(&root).unwrap();
    }
}
