//! `loip list` and `loip rm`: what the cache holds (fetched models, slice directories
//! split for a budget) and removing an entry.
//!
//! The cache is `$LOIP_CACHE`, else `$XDG_CACHE_HOME/loip`, else `~/.cache/loip`. An entry
//! is a directory at its top (a fetched model, `bench-stores`) or under `slices/`; `loip rm`
//! takes the name `loip list` prints and nothing else (no path leaves the cache).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use loip_plan::units::format_bytes;

/// Arguments of `loip list`.
#[derive(Args, Debug)]
pub struct ListArgs {
    /// Print one JSON object per entry (`name`, `kind`, `bytes`, `path`).
    #[arg(long)]
    pub json: bool,
}

/// Arguments of `loip rm`.
#[derive(Args, Debug)]
pub struct RmArgs {
    /// Entries to remove, as `loip list` names them (`smollm2`, `slices/NAME`).
    #[arg(required = true)]
    pub names: Vec<String>,
}

/// One entry of the cache.
struct Entry {
    name: String,
    kind: &'static str,
    path: PathBuf,
}

/// The cache's entries, sorted by name.
fn entries(cache: &Path) -> Result<Vec<Entry>> {
    let mut out = Vec::new();
    let read = |dir: &Path| -> Result<Vec<(String, PathBuf)>> {
        let mut v = Vec::new();
        match std::fs::read_dir(dir) {
            Ok(rd) => {
                for e in rd {
                    let e = e.with_context(|| format!("reading {}", dir.display()))?;
                    v.push((e.file_name().to_string_lossy().into_owned(), e.path()));
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(e).with_context(|| format!("reading {}", dir.display())),
        }
        Ok(v)
    };
    for (name, path) in read(cache)? {
        if name == "slices" && path.is_dir() {
            for (n, p) in read(&path)? {
                out.push(Entry {
                    name: format!("slices/{n}"),
                    kind: "slices",
                    path: p,
                });
            }
        } else {
            let kind = if name == "bench-stores" {
                "bench"
            } else {
                "model"
            };
            out.push(Entry { name, kind, path });
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// Bytes under `path` (symbolic links not followed; what cannot be read counts 0).
fn size(path: &Path) -> u64 {
    let Ok(m) = std::fs::symlink_metadata(path) else {
        return 0;
    };
    if !m.is_dir() {
        return m.len();
    }
    std::fs::read_dir(path)
        .map(|rd| rd.flatten().map(|e| size(&e.path())).sum())
        .unwrap_or(0)
}

/// `loip list`.
pub fn list(a: ListArgs) -> Result<()> {
    let cache = loip_model::fetch::cache_dir();
    let all = entries(&cache)?;
    if !a.json {
        eprintln!("cache {}", cache.display());
    }
    let mut total = 0;
    for e in &all {
        let bytes = size(&e.path);
        total += bytes;
        if a.json {
            let v = serde_json::json!({"name": e.name, "kind": e.kind, "bytes": bytes,
                                       "path": e.path});
            println!("{v}");
        } else {
            println!("{:<48} {:<7} {:>10}", e.name, e.kind, format_bytes(bytes));
        }
    }
    if !a.json {
        eprintln!("{} entries, {}", all.len(), format_bytes(total));
    }
    Ok(())
}

/// `loip rm`: every name must be an entry `loip list` prints; nothing is removed otherwise.
pub fn rm(a: RmArgs) -> Result<()> {
    let cache = loip_model::fetch::cache_dir();
    let all = entries(&cache)?;
    let mut chosen = Vec::new();
    for n in &a.names {
        match all.iter().find(|e| &e.name == n) {
            Some(e) => chosen.push(e),
            None => bail!(
                "no cache entry `{n}` in {} (see `loip list`)",
                cache.display()
            ),
        }
    }
    for e in chosen {
        let bytes = size(&e.path);
        let r = if std::fs::symlink_metadata(&e.path).is_ok_and(|m| m.is_dir()) {
            std::fs::remove_dir_all(&e.path)
        } else {
            std::fs::remove_file(&e.path)
        };
        r.with_context(|| format!("removing {}", e.path.display()))?;
        eprintln!("removed {} ({})", e.name, format_bytes(bytes));
    }
    Ok(())
}
